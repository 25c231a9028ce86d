"""tests/rank_processes.py: a launch whose port another process took first is run again on a new port."""
from __future__ import annotations

import os
import sys

import pytest

import rank_processes

# Rank 0 binds MASTER_PORT as torch's TCPStore does (and says EADDRINUSE as it does when it
# cannot); rank 1 connects and waits for rank 0's word, forever if something else holds the port.
RANK = """import os, socket, sys, time
port = int(os.environ["MASTER_PORT"])
if os.environ["RANK"] == "0":
    server = socket.socket()
    try:
        server.bind(("127.0.0.1", port))
    except OSError:
        sys.exit("code: -98, name: EADDRINUSE")
    server.listen()
    conn, _ = server.accept()
    conn.sendall(b"hello")
else:
    while True:
        try:
            conn = socket.create_connection(("127.0.0.1", port))
            break
        except OSError:
            time.sleep(0.05)
    print(conn.recv(5).decode())
"""


@pytest.mark.slow  # multi-process
@pytest.mark.timeout(60)
def test_a_launch_whose_port_was_taken_runs_again_on_a_new_port(tmp_path, monkeypatch):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    with rank_processes.held_port() as port:
        ports = [port]  # the first launch gets the held port, the next a free one
        free = rank_processes.free_port
        monkeypatch.setattr(rank_processes, "free_port", lambda: ports.pop() if ports else free())
        done = rank_processes.run_ranks([sys.executable, str(script)], 2, dict(os.environ), 30, tmp_path)
    assert [d.returncode for d in done] == [0, 0], [d.stderr for d in done]
    assert done[1].stdout == "hello\n"


@pytest.mark.slow  # multi-process
@pytest.mark.timeout(60)
def test_ranks_not_done_in_time_are_killed_and_named(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(TimeoutError, match=r"hang.py: 2 ranks not done within 1 s"):
        rank_processes.run_ranks([sys.executable, str(script)], 2, dict(os.environ), 1, tmp_path)
