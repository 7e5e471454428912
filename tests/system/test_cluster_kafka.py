"""Cluster-grade faults against a real three-broker KRaft cluster (deploy/local/kafka.sh start --brokers 3:
replication factor 3, min.insync.replicas=2, internal topics the same).

One at-least-once and one exactly-once stream run side by side (open-loop load, two members each)
through a sequence of faults, each measured on its own. The first two land under a backlog (20,000
IDs queued at once in each stream, so every member's in-flight window is full and its commit point
trails by it; issue 46): the leader of an input partition SIGKILLed and kept down 20 s, then the
node coordinating both groups (found with describe_consumer_groups; the two group ids are chosen so
one node coordinates both) SIGKILLed and kept down 20 s; no member may lose its partitions there,
and at least once may redo at most 1% of the fault's stretch. Then, at the open-loop rate: a rolling
restart of the three nodes; the group coordinator's node killed while a member joins and leaves;
the transaction coordinator's node killed mid-transaction; two nodes down at once (below
min.insync.replicas, and below the controller quorum; at-least-once only: no transaction can end
without a quorum). About 6.5 minutes on the shared 2-core machine. Then a worker in
a network namespace of its own loses its link to the cluster for longer than its session, and works
through a slow, lossy link. Every ID must arrive; exactly-once has no duplicates for a read_committed
reader; at-least-once prints its duplicates; each fault's recovery time (throughput back to 80% of
what it was before) is measured and printed (and appended to $KWE_CLUSTER_REPORT when set).

The cluster runs in a network namespace when the machine allows one (the cut-network test needs
it and is skipped, naming what is missing, when it does not); otherwise on 127.0.0.1.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster_tools import Cluster, Net, NetUnavailable, Stream, fault, start_cluster
from worker.kafka.client_config import SESSION_TIMEOUT_MS

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.cluster]

RATE = 100.0  # keywords/s per stream: well under what two members do, so recovery shows as a rate
RECOVERY_GOAL_S = 30.0
DUPLICATES_GOAL = 0.02  # at-least-once: duplicates per fault, as a share of the stream
# IDs queued at once in each stream before a fault under a backlog: more than the two members drain
# during the fault, so their windows are full when the node dies (issue 46).
BACKLOG = 20_000
BACKLOG_DUPLICATES_GOAL = 0.01  # at-least-once, a fault under a backlog: of the IDs of its stretch


@pytest.fixture(scope="module")
def net() -> Iterator[Net | str]:
    """The namespaces and links, or why they cannot be made here."""
    try:
        made = Net.create()
    except NetUnavailable as exc:
        yield str(exc)
        return
    try:
        yield made
    finally:
        made.remove()


@pytest.fixture(scope="module")
def cluster(net: Net | str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from start_cluster(tmp_path_factory.mktemp("cluster") / "run", net if isinstance(net, Net) else None)


def check(streams: list[Stream]) -> None:
    """Every ID arrived (Stream.finish asserted it); the per-fault goals."""
    for st in streams:
        print("\n" + st.report())
    for st in streams:
        assert not st.failed_deliveries, st.failed_deliveries[:3]
        for f in st.faults:
            assert f.lost == 0, f"{st.guarantee}, {f.name}: {f.lost} IDs lost"
            if st.guarantee == "exactly-once":
                assert f.duplicates == 0, f"{st.guarantee}, {f.name}: {f.duplicates} duplicates"
            else:
                assert f.duplicates <= DUPLICATES_GOAL * len(st.sent), f"{f.name}: {f.duplicates} duplicates"
            if f.backlog:
                # Issue 46: a node's loss under a backlog kept both members' partitions (sessions that
                # outlive the coordinator's failover) and cost at most 1% of its stretch in redone work.
                assert f.lost_partitions == 0, f"{st.guarantee}, {f.name}: a member lost its partitions"
                if st.guarantee == "at-least-once":
                    assert f.duplicates <= BACKLOG_DUPLICATES_GOAL * f.ids, \
                        f"{f.name}: {f.duplicates} duplicates of {f.ids} IDs"
            goal = f.recovery_goal_s or RECOVERY_GOAL_S
            assert f.recovery_s is not None and f.recovery_s <= goal, \
                f"{st.guarantee}, {f.name}: throughput not back within {goal} s ({f.recovery_s})"


def test_topics_the_worker_creates_take_the_clusters_replication(cluster: Cluster) -> None:
    from worker.kafka.admin import ensure_topics

    name = f"rf-{time.monotonic_ns()}"
    assert ensure_topics(cluster.bootstrap, {name: 2}) == [name]
    assert {p: len(r) for p, r in cluster.replicas(name).items()} == {0: 3, 1: 3}


def test_a_member_starts_while_a_node_it_still_sees_in_the_metadata_is_down(cluster: Cluster) -> None:
    """The start-up check must not stop a member because one of three brokers is down. For ~9 s
    after a SIGKILL (broker.session.timeout.ms) the cluster still lists the dead node and may name
    it as the 'controller' that librdkafka sends DescribeTopics to; one 10 s attempt then timed out
    and the member exited 2 ("cannot reach the Kafka cluster"), which the join-while-the-coordinator-
    is-down fault below found. Every check in that window must pass now."""
    from worker.kafka.admin import ensure_topics
    from worker.kafka.client_config import admin_config
    from worker.kafka.preflight import check_topics
    from worker.settings.schema import Settings

    tag = f"pre{time.monotonic_ns() % 10**6}"
    topics = {f"kw-{tag}": 3, f"emb-{tag}": 3, f"dlq-{tag}": 1}
    ensure_topics(cluster.bootstrap, topics)
    s = Settings(bootstrap_servers=cluster.bootstrap, input_topic=f"kw-{tag}", output_topic=f"emb-{tag}",
                 dead_letter_topic=f"dlq-{tag}", group_id=f"g-{tag}")
    check_topics(admin_config(s), s)
    node = cluster.leader(f"kw-{tag}", 0)
    back = cluster.restart(node, hard=True, down_for=12)
    time.sleep(0.5)
    times = []
    end = time.monotonic() + 8.0  # inside the window before the controller fences the dead node
    while time.monotonic() < end:
        t = time.monotonic()
        check_topics(admin_config(s), s)
        times.append(round(time.monotonic() - t, 1))
    out, _ = back.communicate(timeout=240)
    assert back.returncode == 0, out
    print(f"\nstart-up checks with node {node} just killed: {len(times)} passed, seconds each: {times}")
    cluster.wait_in_sync()


@pytest.mark.timeout(1200)
def test_leader_kill_rolling_restart_coordinators_and_two_nodes_down_under_both_guarantees(
        cluster: Cluster, tmp_path: Path) -> None:
    alo_tag = f"alo{time.monotonic_ns() % 10**6}"
    coordinator = cluster.group_coordinator(f"g-{alo_tag}")
    alo = Stream(cluster, alo_tag, "at-least-once", tmp_path, rate=RATE)
    # Both groups on one coordinator: one kill takes it from both guarantees.
    eos = Stream(cluster, cluster.tag_coordinated_by(coordinator, "eos"), "exactly-once", tmp_path, rate=RATE,
                 extra=["--transaction-timeout-ms", "60000"])
    streams = [alo, eos]
    try:
        for st in streams:
            st.member("m1")
            st.member("m2")
        for st in streams:
            st.start()

        # A leader that coordinates neither group: the next fault is the coordinator's. Found before the
        # fault: under a backlog the kill must come at once.
        part, node = next((p, n) for p in range(6) if (n := cluster.leader(alo.topics[0], p)) != coordinator)

        def leader_down() -> str:
            cluster.restart_now(node, hard=True, down_for=20)
            return (f"node {node} (leader of the input's partition {part}, no group's coordinator) SIGKILLed, "
                    "back after 20 s")

        fault(streams, "leader SIGKILLed under a backlog, 20 s down", leader_down, backlog=BACKLOG)
        cluster.wait_in_sync()

        nodes = {cluster.group_coordinator(st.group) for st in streams}
        assert nodes == {coordinator}, f"the groups' coordinators moved: {nodes}"

        def coordinator_down() -> str:
            cluster.restart_now(coordinator, hard=True, down_for=20)
            return (f"node {coordinator} (both groups' coordinator, by describe_consumer_groups) SIGKILLed, "
                    "back after 20 s")

        fault(streams, "group coordinator SIGKILLed under a backlog, 20 s down", coordinator_down, backlog=BACKLOG)
        cluster.wait_in_sync()

        def rolling() -> str:
            for node in (1, 2, 3):
                cluster.restart_now(node)
                cluster.wait_in_sync()
            return "SIGTERM, restart, wait for every replica in sync; nodes 1, 2, 3"

        fault(streams, "rolling restart of the three nodes", rolling)

        def group_coordinator() -> str:
            node = cluster.group_coordinator(alo.group)
            eos_node = cluster.group_coordinator(eos.group)
            joining = [st.member("m3") for st in streams]
            cluster.restart_now(node, hard=True, down_for=10)
            for w in joining:
                w.wait_ready(180)
            for st in streams:
                st.leave("m3")
            return (f"node {node} SIGKILLed for 10 s (coordinator of the at-least-once group; of the "
                    f"exactly-once group: node {eos_node}) while m3 joins, then m3 leaves")

        fault(streams, "group coordinator's node killed, members join and leave", group_coordinator)
        cluster.wait_in_sync()

        def transaction_coordinator() -> str:
            node = cluster.transaction_coordinator(eos.transactional_id("m1"))
            cluster.restart_now(node, hard=True, down_for=10)
            return f"node {node} (transaction coordinator of exactly-once m1) SIGKILLed mid-transaction, 10 s down"

        fault(streams, "transaction coordinator's node killed", transaction_coordinator)
        cluster.wait_in_sync()

        # Two nodes down stops the controller quorum too: no transaction can end. The exactly-once
        # stream ends here (every ID, read_committed, once); the outage runs under at-least-once.
        eos.finish()

        def two_down() -> str:
            first = cluster.leader(alo.topics[0], 0)
            second = next(n for n in (1, 2, 3) if n != first)
            members = [w for n, w in alo.members.items() if n not in alo.leaving]
            back = cluster.restart(first, hard=True, down_for=20)
            later = cluster.restart(second, hard=True, down_for=30)
            t0 = time.monotonic()
            unhealthy: list[str] = []
            seen_at_5s: int | None = None
            while back.poll() is None:
                for w in members:
                    code = w.probe("/healthz")
                    if code != 200:
                        unhealthy.append(f"{w.log_path.name}: {code} at {time.monotonic() - t0:.0f} s")
                if time.monotonic() - t0 > 5 and seen_at_5s is None:
                    seen_at_5s = len(alo.arrivals)
                time.sleep(1.0)
            assert back.returncode == 0, back.communicate()[0]
            during = len(alo.arrivals) - (seen_at_5s if seen_at_5s is not None else len(alo.arrivals))
            assert not unhealthy, f"/healthz not 200 before stall_timeout_s (60 s): {unhealthy[:5]}"
            out, _ = later.communicate(timeout=240)
            assert later.returncode == 0, out
            return (f"nodes {first}+{second} SIGKILLed; {first} back after 20 s, {second} after 30 s; outputs "
                    f"seen from 5 s after the kill to the first return: {during}; /healthz 200 throughout")

        # No quorum, so no coordinator until the first node is back and the group is loaded again, past
        # the 30 s session: the members lose their partitions then, and their rejoin took 40 s (with
        # 10 s sessions, lost 10 s into the outage, it ended 36 s after the loss, about when the
        # coordinator was back; the broker seems to keep the old identities for a session). Recovery
        # 20-27 s measured (0-5 s with 10 s sessions): a session more than the others' goal.
        fault([alo], "two nodes down (below min.insync.replicas)", two_down,
              recovery_goal_s=RECOVERY_GOAL_S + SESSION_TIMEOUT_MS / 1000)
        alo.finish()
    finally:
        for st in streams:
            st.close()
    check(streams)


# Either take-over: a call that hung, or a producer the coordinator fenced or whose transaction it ended
# (INVALID_TXN_STATE once the frozen coordinator's successor answers). Both replace the producer and
# read the committed offsets before any rewind, which is where the SIGTERM must land.
TAKE_OVERS = ("transactional call hung; a new producer takes over",
              "producer fenced, or its transaction ended, by the coordinator; a new producer takes over")


def taking_over(st: Stream) -> list[str]:
    return [n for n, w in st.members.items() if n not in st.leaving and any(w.events(e) for e in TAKE_OVERS)]


def what_members_did(st: Stream) -> str:
    """Each member's warnings and errors, counted by event: what a failed wait prints."""
    lines = []
    for name, w in st.members.items():
        seen = Counter(str(e.get("event"))[:160] for e in w.events() if e.get("level") in ("warning", "error"))
        lines.append(f"{name}: " + "; ".join(f"{n}x {ev}" for ev, n in seen.most_common(12)))
    return "\n".join(lines)


@pytest.mark.timeout(900)
def test_a_sigterm_during_a_take_over_loses_nothing_and_exits_0(cluster: Cluster, tmp_path: Path) -> None:
    """Issue 32, finding 1. The exactly-once group's coordinator node is frozen (SIGSTOP): a
    send_offsets_to_transaction to it hangs, and a new producer takes over. The member is SIGTERMed
    as it logs the take-over, while the new producer initialises or the group's committed offsets
    are read from the frozen coordinator, before any rewind. It must exit 0 and commit nothing past
    the hung transaction's records: a read_committed reader sees every ID once, after the node is
    back and the other member has the partitions."""
    eos = Stream(cluster, f"tko{time.monotonic_ns() % 10**6}", "exactly-once", tmp_path, rate=RATE,
                 extra=["--transaction-timeout-ms", "60000"])
    try:
        eos.member("m1")
        eos.member("m2")
        eos.start()

        def stop_during_take_over() -> str:
            node = cluster.group_coordinator(eos.group)
            cluster.freeze(node)
            try:
                # A hung call is taken over after 15 s; an abort or commit that keeps timing out
                # (the partitions lost meanwhile) after transaction_timeout_ms of resumed calls. A
                # member whose transaction outlived transaction_timeout_ms (60 s) meanwhile, or whose
                # resumed abort the coordinator answers INVALID_TXN_STATE, takes over after 5 s
                # (either take-over will do: CI once waited 240 s for the hung one while, most likely,
                # the other had come first). Hence up to 240 s.
                wait_s = 240
                deadline = time.monotonic() + wait_s
                while True:
                    taking = taking_over(eos)
                    if taking:
                        break
                    eos.check_members()
                    assert time.monotonic() < deadline, \
                        f"no take-over within {wait_s} s of freezing node {node}:\n{what_members_did(eos)}"
                    time.sleep(0.1)
                eos.leave(taking[0])  # SIGTERM on the take-over line; it must exit 0
            finally:
                cluster.freeze(node, frozen=False)
            after = [e.get("during") for e in eos.members[taking[0]].events(
                "stopping with the transaction unfinished: nothing more is consumed or committed; the partitions "
                "resume from the group's committed offsets")]
            return (f"node {node} (the group's coordinator) frozen until {taking[0]}, SIGTERMed as it logged the "
                    f"take-over, exited 0; stopped during: {after or 'after the take-over'}")

        fault([eos], "SIGTERM during a take-over (coordinator frozen)", stop_during_take_over)
        cluster.wait_in_sync()
        eos.finish()
    finally:
        eos.close()
    check([eos])


def test_a_cut_network_and_a_slow_lossy_link(cluster: Cluster, net: Net | str, tmp_path: Path) -> None:
    if not isinstance(net, Net):
        pytest.skip(f"network namespaces unavailable: {net}")
    st = Stream(cluster, f"net{time.monotonic_ns() % 10**6}", "at-least-once", tmp_path, rate=RATE)
    try:
        # The far member's session at 10 s (the worker's is 30 s): the cut outlives it, and the test
        # stays as short as it was.
        far = st.member("far", prefix=net.in_worker_ns(), host=net.worker_host,
                        extra=["--kafka-config", "session.timeout.ms=10000"])
        st.member("near")
        st.start()

        def cut() -> str:
            net.cut()
            time.sleep(25)  # past the far member's session timeout (10 s): the group moves on without it
            net.restore()
            return "the far member's link down 25 s (its session.timeout.ms 10 s), then up"

        fault([st], "network cut for longer than the session", cut)
        far.wait_ready(120)

        def slow_lossy() -> str:
            net.slow("1mbit")
            why_not = net.lossy(3)
            time.sleep(25)
            dropped = net.dropped()
            net.clear()
            lossy = f"nftables dropping 3% of packets both ways ({dropped} dropped)" if why_not is None \
                else f"no packet loss: {why_not}"
            return f"the far member's egress at 1 Mbit/s (tc tbf) and {lossy}, 25 s"

        fault([st], "slow, lossy link under load", slow_lossy)
        st.finish()
    finally:
        net.clear()
        net.restore()
        st.close()
    check([st])
