"""`omnistage serve` starts the workers' fork server from the files' kinds before it imports its
own libraries, so both processes' seconds of imports overlap (runtime/fork_server.py).

Judge: the kernel's process table — the fork server's start time against the moment the
server's port first accepts, and the module list on the fork server's command line."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from omnistage.runtime.fork_server import kinds_in_files
from omnistage.tests.serving.conftest import cmdline, descendants, start_server


def started_at(pid: int) -> float:
    """The process's start, in seconds of CLOCK_BOOTTIME (field 22 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def test_the_fork_server_starts_before_the_server_listens(tmp_path):
    server = start_server(["tiny-llm"], tmp_path / "serve.log")
    try:
        end = time.monotonic() + 120
        while True:
            assert server.proc.poll() is None, server.log()
            try:
                socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
                listening = time.clock_gettime(time.CLOCK_BOOTTIME)
                break
            except OSError:
                assert time.monotonic() < end, server.log()
                time.sleep(0.01)
        fork_servers = [p for p in descendants(server.proc.pid) if "multiprocessing.forkserver" in cmdline(p)]
        assert len(fork_servers) == 1, [cmdline(p) for p in descendants(server.proc.pid)]
        # started first, it was not waiting on this process's own seconds of imports
        assert started_at(fork_servers[0]) < listening - 1.0
        line = Path(f"/proc/{fork_servers[0]}/cmdline").read_bytes().decode()
        assert "omnistage.stages.ar.stage" in line and "omnistage.stages.diffusion" not in line
        server.wait_ready()
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.log()


def test_kinds_are_read_from_the_files_without_validation(tmp_path):
    assert kinds_in_files(["tiny-llm", "tiny-image"]) == ["ar_lm", "text_encoder", "denoiser", "vae_decoder"]
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("name: x\nstages:\n  a: {kind: no_such_kind}\n")
    assert kinds_in_files([unknown]) == []
    for text in ("name: [unclosed", "just text", "stages: 3"):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        assert kinds_in_files(["tiny-llm", bad]) is None  # the normal start reports the file's errors
    assert kinds_in_files([tmp_path / "missing.yaml"]) is None
    # what only the loader can tell: the early start steps aside
    listed = tmp_path / "listed.yaml"
    listed.write_text("name: x\nstages:\n  a: {kind: [ar_lm]}\n")
    by_var = tmp_path / "by_var.yaml"
    by_var.write_text("name: x\nstages:\n  a: {kind: '${K:-ar_lm}'}\n")
    bad_date = tmp_path / "bad_date.yaml"
    bad_date.write_text("name: x\ndescription: 2020-13-45\nstages:\n  a: {kind: ar_lm}\n")
    for path in (listed, by_var, bad_date, tmp_path):  # (a folder is not a file)
        assert kinds_in_files(["tiny-llm", path]) is None
    assert kinds_in_files(["tiny-llm"], ["stages.llm.kind=torch_module"]) is None
    assert kinds_in_files(["tiny-llm"], ["stages.llm.pool.threads=2"]) == ["ar_lm"]


def test_a_piped_config_is_read_once_by_the_loader(tmp_path):
    """A pipe can be read once: the early start leaves it to the loader (`serve <(...)`)."""
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as w:
        w.write(Path(__file__).parents[2].joinpath("configs", "tiny-llm.yaml").read_text())
    try:
        assert kinds_in_files([f"/dev/fd/{read_end}"]) is None
        assert "stages:" in os.read(read_end, 1 << 16).decode()  # still unread
    finally:
        os.close(read_end)
