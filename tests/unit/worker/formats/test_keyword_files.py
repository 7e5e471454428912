"""The one reader of keyword files (produce, embed, bench, demo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.formats.keyword_files import BadLines, KeywordFileError, read_keywords


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_tsv_keeps_tabs_in_text_and_skips_blank_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "q.tsv", b"1\tcheap flights\r\n\n2\tcaf\xc3\xa9\tparis\n")
    assert list(read_keywords(path, "tsv")) == [("1", "cheap flights"), ("2", "caf\u00e9\tparis")]


def test_auto_reads_jsonl_by_suffix_and_lines_without_a_tab(tmp_path: Path) -> None:
    jl = write(tmp_path, "q.jsonl", b'{"id": "a", "text": "x"}\n{"id": 7, "text": "y", "more": 1}\n')
    assert list(read_keywords(jl)) == [("a", "x"), ("7", "y")]
    mixed = write(tmp_path, "q.txt", b"q1\tshoes\njust text\n")
    assert list(read_keywords(mixed)) == [("q1", "shoes"), ("2", "just text")]


def test_limit_counts_keywords_not_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "q.tsv", b"1\ta\n\n2\tb\n3\tc\n")
    assert [q for q, _ in read_keywords(path, "tsv", limit=2)] == ["1", "2"]


@pytest.mark.parametrize(("name", "data", "fmt", "message"), [
    ("q.tsv", b"1\tok\nno tab here\n", "tsv", r"q\.tsv:2: expected id<TAB>text"),
    ("q.jsonl", b'{"id": "a"}\n', "auto", r"q\.jsonl:1: expected a JSON object"),
    ("q.tsv", b"1\t\xff\n", "tsv", r"not UTF-8"),
])
def test_errors_name_the_file_and_line(tmp_path: Path, name: str, data: bytes, fmt: str, message: str) -> None:
    with pytest.raises(KeywordFileError, match=message):
        list(read_keywords(write(tmp_path, name, data), fmt))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(KeywordFileError, match="nope.tsv"):
        list(read_keywords(tmp_path / "nope.tsv"))


def test_a_lenient_read_skips_and_counts_bad_lines(tmp_path: Path) -> None:
    data = (b"1\tcheap flights\n"
            b"2\tcaf\xe9\n"            # Latin-1, not UTF-8
            b"\n"
            b"no tab\n"
            b"3\tused cars\r\n"
            b"4\t\xff\xfe\n")
    path = write(tmp_path, "q.tsv", data)
    bad = BadLines()
    assert list(read_keywords(path, "tsv", bad=bad)) == [("1", "cheap flights"), ("3", "used cars")]
    assert (bad.count, bad.first_line) == (3, 2) and "not UTF-8" in bad.first_reason
    assert "skipped 3 bad lines (first: line 2, not UTF-8" in bad.summary(path) and "--strict" in bad.summary(path)
    # The same file read strictly stops at the first bad line, naming it.
    with pytest.raises(KeywordFileError, match=r"q\.tsv:2: not UTF-8"):
        list(read_keywords(path, "tsv"))
    # A limit counts the keywords read, so skipped lines do not use it up.
    assert [q for q, _ in read_keywords(path, "tsv", limit=2, bad=BadLines())] == ["1", "3"]


def test_a_lenient_jsonl_read_skips_objects_without_id_or_text(tmp_path: Path) -> None:
    path = write(tmp_path, "q.jsonl", b'{"id": "a", "text": "x"}\n{"id": "b"}\nnot json\n{"id": 1, "text": "y"}\n')
    bad = BadLines()
    assert list(read_keywords(path, bad=bad)) == [("a", "x"), ("1", "y")]
    assert (bad.count, bad.first_line) == (2, 2)
