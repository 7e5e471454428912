"""The ledger: commit-after-write in one folder. Each record's offset (offsets.py), the records still
out (inflight.py), their acknowledgement (acks.py), the commits (committer.py), and the two
guarantees behind one interface: at least once (at_least_once.py) beside exactly once (exactly_once/),
the pick between them in guarantees.py."""
