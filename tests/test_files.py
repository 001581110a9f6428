"""Every file kvscope reads whole is a regular file read to a limit (kvscope.files).

The paths are those an operator can point kvscope at: an ingest source (detected, ``--kind`` or
``KIND:FILE``), the boundary hash key file and workload traces. A symlink to /dev/zero, a FIFO
with no writer, a folder and a sparse file larger than the limit must each give one line naming
the file, at once and without reading the file into memory.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvscope.boundary_key import read_key_file, resolve_boundary_key
from kvscope.collector.ingest import ingest, server_log
from kvscope.collector.ingest.spans import MAX_SOURCE_BYTES
from kvscope.emulator.workloads import mooncake, weka
from kvscope.errors import IngestError, KvscopeError, SettingError
from kvscope.files import read_limited


def _zero_link(tmp_path: Path) -> Path:
    link = tmp_path / "zero.log"
    link.symlink_to("/dev/zero")
    return link


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "pipe.log"
    os.mkfifo(path)
    return path


def _sparse(tmp_path: Path, size: int = MAX_SOURCE_BYTES + 1) -> Path:
    path = tmp_path / "sparse.log"
    with open(path, "wb") as out:
        out.truncate(size)  # no blocks on disk: a large file made at no cost
    return path


def _folder(tmp_path: Path) -> Path:
    path = tmp_path / "folder.log"
    path.mkdir()
    return path


NOT_FILES: list[tuple[Callable[[Path], Path], str]] = [
    (_zero_link, "is a device, not a regular file"),
    (_fifo, "is a FIFO, not a regular file"),
    (_folder, "is a folder, not a regular file"),
    (_sparse, f"larger than the {MAX_SOURCE_BYTES >> 20:g} MiB kvscope reads"),
]


def _bounded(call: Callable[[], object], error: type[KvscopeError]) -> str:
    """``call()``'s one-line error; a thread so that a hang fails the test instead of pytest."""
    caught: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            caught.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "the read did not return (blocked, or reading forever)"
    assert caught and isinstance(caught[0], error), caught
    text = str(caught[0])
    assert "\n" not in text
    return text


@pytest.mark.parametrize(("make", "message"), NOT_FILES)
@pytest.mark.parametrize("how", ["detected", "--kind", "KIND:FILE"])
def test_ingest_reads_only_regular_files_to_a_limit(
    tmp_path: Path, make: Callable[[Path], Path], message: str, how: str
) -> None:
    path = make(tmp_path)
    db = tmp_path / "run.duckdb"
    kind = server_log.KIND_DECODE
    if how == "detected":
        call = lambda: ingest(db, [path])  # noqa: E731
    elif how == "--kind":
        call = lambda: ingest(db, [path], kind=kind)  # noqa: E731
    else:
        call = lambda: ingest(db, [f"{kind}:{path}"])  # noqa: E731
    text = _bounded(call, IngestError)
    if how == "detected" and make is _sparse:
        # Its head (NUL bytes) is of no kind: refused by that, before it is read whole.
        message = "not a kind of source kvscope knows"
        assert text.startswith(f"{path}: ") and message in text, text
    else:
        assert text.startswith(f"ingest source {path}: ") and message in text, text
    assert not db.exists()


@pytest.mark.parametrize(("make", "message"), NOT_FILES[:3])
def test_a_key_file_that_is_not_a_regular_file_is_refused(
    tmp_path: Path, make: Callable[[Path], Path], message: str
) -> None:
    path = make(tmp_path)
    text = _bounded(lambda: read_key_file(path), SettingError)
    assert text.startswith(f"boundary hash key file {path}: ") and message in text


def test_a_large_key_file_is_refused_unread(tmp_path: Path) -> None:
    path = _sparse(tmp_path, 200 << 20)
    text = _bounded(lambda: read_key_file(path), SettingError)
    assert "209715200 bytes, larger than the 4 KiB kvscope reads" in text


def test_a_symlink_at_the_default_key_path_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "kvscope"
    folder.mkdir(mode=0o700)
    elsewhere = tmp_path / "planted.key"
    elsewhere.write_text("ab" * 32 + "\n")
    (folder / "boundary-hash.key").symlink_to(elsewhere)
    with pytest.raises(SettingError, match="is a symlink, and nobody configured it"):
        resolve_boundary_key(environ={"XDG_STATE_HOME": str(tmp_path)})


def test_a_world_writable_state_folder_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "kvscope"
    folder.mkdir()
    folder.chmod(0o777)
    key = resolve_boundary_key(environ={"XDG_STATE_HOME": str(tmp_path)})
    assert key.source == str(folder / "boundary-hash.key")
    assert "writable by other users" in caplog.text


@pytest.mark.parametrize(("make", "message"), NOT_FILES[:3])
def test_workload_traces_are_read_only_from_regular_files(
    tmp_path: Path, make: Callable[[Path], Path], message: str
) -> None:
    path = make(tmp_path)
    for load in (lambda: weka.load_csv(path), lambda: weka.load_raw([path]),
                 lambda: mooncake.load(path)):
        assert message in _bounded(load, KvscopeError)


def test_the_head_of_a_large_file_is_read_without_refusal(tmp_path: Path) -> None:
    path = _sparse(tmp_path, 1 << 30)
    assert read_limited(path, 4096, "x", IngestError, head=True) == b"\0" * 4096
    with pytest.raises(IngestError, match="larger than the 4 KiB"):
        read_limited(path, 4096, "x", IngestError)
