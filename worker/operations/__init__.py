"""Operations: metrics, the probe server, liveness, logs, secrets kept out of them, stop signals."""
