"""The worker control plane: a real worker answers over its unix socket."""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastrun.control_plane import (
    ELASTRUN_WORKER_SERVER_SOCKET,
    TORCH_WORKER_SERVER_SOCKET,
    WorkerServer,
    WorkerServerError,
    call_handler,
    dump_stacks,
    fetch_many_stacks,
    fetch_stacks,
    list_handlers,
    serve_from_env,
    worker_main,
)
from elastrun.wire.env import ERROR_FILE_ENV

# (the process, its socket, its error file, the file that tells it to go on and fail)
RunningWorker = tuple[subprocess.Popen[str], Path, Path, Path]

WORKER = """
    import os
    import sys
    import time

    from elastrun.control_plane import worker_main

    def waiting_for_the_go_file(path):
        print("ready", flush=True)  # from here on, a stack dump shows this function
        while not os.path.exists(path):
            time.sleep(0.02)

    with worker_main():
        waiting_for_the_go_file(sys.argv[1])
        raise ValueError("boom from the with body")
"""


def wait_for_socket(path: Path, proc: subprocess.Popen[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"worker exited early: {proc.communicate()}")
        try:
            if call_handler(str(path), "ping", timeout=2) == b"pong":
                return
        except WorkerServerError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"no worker server at {path}")


def raw_request(path: Path, method: str, target: str) -> tuple[int, bytes]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(str(path))
    try:
        sock.sendall(f"{method} {target} HTTP/1.1\r\nHost: w\r\nContent-Length: 0\r\n\r\n".encode())
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, response.read()
    finally:
        sock.close()


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[RunningWorker]:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    sock = tmp_path / "worker.sock"
    error_file = tmp_path / "error.json"
    go = tmp_path / "go"
    env = {**os.environ, TORCH_WORKER_SERVER_SOCKET: str(sock), ERROR_FILE_ENV: str(error_file)}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(go)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_socket(sock, proc)
        # The server answers as soon as worker_main starts it, before the main thread is
        # in the function the tests look for in its stacks: under load that takes a while.
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        yield proc, sock, error_file, go
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def test_worker_answers_ping_with_pong(
    worker: RunningWorker,
) -> None:
    _, sock, _, _ = worker
    assert call_handler(str(sock), "ping") == b"pong"


def test_dump_traceback_shows_the_function_the_worker_is_waiting_in(
    worker: RunningWorker,
) -> None:
    _, sock, _, _ = worker
    stacks = fetch_stacks(str(sock))
    assert '"MainThread"' in stacks
    assert "in waiting_for_the_go_file" in stacks
    assert "time.sleep(0.02)" in stacks
    # The server's own threads are named, but their stacks are noise.
    assert "the worker server, stack omitted" in stacks
    assert "selector.select()" not in stacks


def test_handler_list_names_the_handlers(
    worker: RunningWorker,
) -> None:
    _, sock, _, _ = worker
    assert {"ping", "dump_traceback"} <= set(list_handlers(str(sock)))
    status, body = raw_request(sock, "GET", "/handler/")
    assert status == 200
    assert set(json.loads(body)) == {"ping", "dump_traceback"}


def test_unknown_handler_and_path_answer_404(
    worker: RunningWorker,
) -> None:
    _, sock, _, _ = worker
    status, body = raw_request(sock, "POST", "/handler/nope")
    assert status == 404
    assert b"nope" in body
    assert raw_request(sock, "GET", "/elsewhere")[0] == 404
    with pytest.raises(WorkerServerError, match="404"):
        call_handler(str(sock), "nope")


def test_exception_in_the_with_body_is_written_to_the_error_file(
    worker: RunningWorker,
) -> None:
    proc, sock, error_file, go = worker
    go.touch()
    assert proc.wait(timeout=30) == 1
    document = json.loads(error_file.read_text())
    assert document["message"]["message"] == "ValueError: boom from the with body"
    assert "waiting_for_the_go_file" not in document["message"]["extraInfo"]["py_callstack"]
    assert "raise ValueError" in document["message"]["extraInfo"]["py_callstack"]
    assert not sock.exists(), "the socket file is removed when the body ends"


def test_fetch_many_stacks_reports_each_worker_or_its_error(
    worker: RunningWorker, tmp_path: Path
) -> None:
    _, sock, _, _ = worker
    missing = tmp_path / "gone.sock"
    results = fetch_many_stacks([str(sock), str(missing)], timeout=5)
    assert list(results) == [str(sock), str(missing)]
    assert "waiting_for_the_go_file" in str(results[str(sock)])
    assert isinstance(results[str(missing)], WorkerServerError)


# ----------------------------------------------------------------------------- in process


def test_server_works_on_a_path_too_long_for_sockaddr_un(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = str(deep / "worker.sock")
    assert len(path) > 108
    with WorkerServer(path):
        assert call_handler(path, "ping") == b"pong"
    assert not os.path.exists(path)


def test_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays, nobody listens
    with WorkerServer(str(path)):
        assert call_handler(str(path), "ping") == b"pong"


def test_live_socket_and_regular_file_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "live.sock"
    with WorkerServer(str(path)):
        with pytest.raises(WorkerServerError, match="another server"):
            WorkerServer(str(path)).start()
        assert call_handler(str(path), "ping") == b"pong"
    regular = tmp_path / "file"
    regular.write_text("x")
    with pytest.raises(WorkerServerError, match="not a socket"):
        WorkerServer(str(regular)).start()


def test_shutdown_is_prompt_and_idempotent(tmp_path: Path) -> None:
    server = WorkerServer(str(tmp_path / "w.sock"))
    server.start()
    started = time.monotonic()
    server.shutdown()
    server.shutdown()
    assert time.monotonic() - started < 1.0
    assert "running=False" in repr(server)


def test_failing_handler_answers_500(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> tuple[bytes, str]:
        raise RuntimeError("handler bug")

    path = str(tmp_path / "w.sock")
    with (
        caplog.at_level(logging.CRITICAL),
        WorkerServer(path, {"broken": broken}),
        pytest.raises(WorkerServerError, match=r"500.*handler bug"),
    ):
        call_handler(path, "broken")


def test_dump_stacks_lists_every_thread_main_first() -> None:
    release = threading.Event()
    helper = threading.Thread(target=release.wait, name="helper-thread")
    helper.start()
    try:
        text = dump_stacks()
        omitted = dump_stacks(omit={helper.ident or 0})
    finally:
        release.set()
        helper.join()
    assert text.startswith(f'Thread {threading.main_thread().ident} "MainThread"')
    assert "test_dump_stacks_lists_every_thread_main_first" in text
    assert '"helper-thread" (most recent call last)' in text
    assert '"helper-thread": the worker server, stack omitted' in omitted


def test_worker_main_records_the_body_exception_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(error_file))
    monkeypatch.delenv(TORCH_WORKER_SERVER_SOCKET, raising=False)
    with pytest.raises(KeyError), worker_main():
        raise KeyError("missing")
    assert json.loads(error_file.read_text())["message"]["message"] == "KeyError: 'missing'"


def test_worker_main_does_not_record_system_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(error_file))
    with pytest.raises(SystemExit), worker_main():
        sys.exit(3)
    assert not error_file.exists()


def test_worker_main_works_as_a_decorator_and_serves_while_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "w.sock"
    monkeypatch.setenv(TORCH_WORKER_SERVER_SOCKET, str(path))

    @worker_main()
    def main() -> bytes:
        return call_handler(str(path), "ping")

    assert main() == b"pong"
    assert not path.exists()


def test_worker_main_runs_the_body_when_the_server_cannot_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-socket"
    blocker.write_text("")
    monkeypatch.setenv(TORCH_WORKER_SERVER_SOCKET, str(blocker))
    ran = False
    with caplog.at_level(logging.WARNING), worker_main():
        ran = True
    assert ran
    assert "worker server not started" in caplog.text


def test_serve_from_env_uses_the_elastrun_variable(tmp_path: Path) -> None:
    assert serve_from_env({}) is None
    path = str(tmp_path / "e.sock")
    server = serve_from_env({ELASTRUN_WORKER_SERVER_SOCKET: path})
    assert server is not None
    try:
        assert call_handler(path, "ping") == b"pong"
    finally:
        server.shutdown()


# ----------------------------------------------------------------------------- torch


TORCH_WORKER = """
    import sys
    import time

    from torch._C._distributed_c10d import _WorkerServer

    def torch_worker_idling():
        while True:
            time.sleep(0.05)

    server = _WorkerServer(sys.argv[1])
    torch_worker_idling()
"""


@pytest.mark.torch
def test_client_works_against_torch_worker_server(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "torch_worker.py"
    script.write_text(textwrap.dedent(TORCH_WORKER))
    sock = tmp_path / "torch.sock"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(sock)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_socket(sock, proc, timeout=90)
        assert "torch_worker_idling" in fetch_stacks(str(sock))
        assert {"ping", "dump_traceback"} <= set(list_handlers(str(sock)))
    finally:
        proc.kill()
        proc.communicate(timeout=30)
