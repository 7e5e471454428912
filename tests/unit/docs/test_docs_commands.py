"""Every shell command in the README and docs/ names flags, targets, scripts and extras that exist
(tests/docs_commands.py). The blocks marked `<!-- docs-test: run -->` run as written against the
broker in tests/broker/test_docs_commands_kafka.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.docs_commands import RUN_MARK, Block, check, commands, doc_files, shell_blocks

BLOCKS = [block for path in doc_files(ROOT) for block in shell_blocks(path)]


def test_the_docs_have_shell_blocks_to_check() -> None:
    assert len(BLOCKS) >= 10, [b.where for b in BLOCKS]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.where.replace(str(ROOT) + "/", ""))
def test_every_documented_command_uses_flags_targets_and_files_that_exist(block: Block) -> None:
    problems = [f"{' '.join(words)}: {problem}" for words in commands(block.body) for problem in check(words, ROOT)]
    assert not problems, f"{block.where}:\n" + "\n".join(problems)


# ------------------------------------------------------------------ the checker itself


def _problems(line: str) -> list[str]:
    return [p for words in commands(line) for p in check(words, ROOT)]


@pytest.mark.parametrize("line", [
    "keyword-embedder run --bootstrap-servers kafka:9092 --no-merge-buckets --merge-buckets=false",
    "KWE_BACKEND=onnxruntime keyword-embedder run --group g   # an alias and a comment",
    "make demo && make test",
    "bash deploy/local/kafka.sh start --brokers 3",
    "deploy/local/kafka.sh stop --secure | tail -n 1",
    ".venv/bin/python -m benchmarks.kafka_ab --rounds 3",
    "python3 -m benchmarks.gpu.prepare_device",
    ".venv/bin/python deploy/tools/prometheus_rule.py --check",
    "python -m pytest tests/unit/worker/settings/test_settings.py",
    "pip install -e '.[registry,otel]'",
    "docker build -f deploy/docker/Dockerfile -t keyword-embedder:0.1.0 .",
    "kcat -b localhost:9092 -t embeddings -C --anything",  # not ours: not checked
])
def test_the_checker_passes_what_exists(line: str) -> None:
    assert _problems(line) == []


@pytest.mark.parametrize(("line", "problem"), [
    ("keyword-embedder run --bootstrap-server kafka:9092", "has no option --bootstrap-server"),
    ("keyword-embedder serve", "no subcommand 'serve'"),
    ("cd x && make demos", "no target 'demos'"),
    ("bash deploy/local/kafka.sh start --nodes 3", "takes no option --nodes"),
    ("bash deploy/local/missing.sh", "does not exist"),
    ("python -m benchmarks.kafka_ab --no-such-flag 3", "takes no option --no-such-flag"),
    (".venv/bin/python -m benchmarks.gone --rounds 3", "benchmarks/gone.py does not exist"),
    (".venv/bin/python benchmarks/kafka_ab.py --rounds 3", "run it as a module, python -m benchmarks.kafka_ab"),
    ("pip install 'keyword-embedder[cuda]'", "no extra 'cuda'"),
    ("keyword-embedder bench \\\n    --rounds 3 --no-such-flag", "has no option --no-such-flag"),
])
def test_the_checker_finds_what_does_not(line: str, problem: str) -> None:
    found = _problems(line)
    assert len(found) == 1 and problem in found[0], found


def test_a_run_mark_is_read_from_the_line_before_the_fence(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(f"text\n\n{RUN_MARK}\n```bash\necho run\n```\n\n```bash\necho not\n```\n", encoding="utf-8")
    blocks = shell_blocks(doc)
    assert [(b.body.strip(), b.run) for b in blocks] == [("echo run", True), ("echo not", False)]

