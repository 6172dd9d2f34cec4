"""A Spark standalone master and worker on loopback, from the pyspark package's own scripts.

`StandaloneCluster` runs ``bin/spark-class`` of the installed pyspark (its
``SPARK_HOME``) for ``deploy.master.Master`` and ``deploy.worker.Worker``,
on 127.0.0.1 with ports chosen by the system (0), the REST submission server
off, and waits, with a deadline, for the master to say where it listens and
for the worker to register: a thread per process copies its output to a log
file and wakes the waiter when a line matches. `stop` ends both process groups.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from pathlib import Path

START_TIMEOUT_SECONDS = 90.0
_MASTER_URL = re.compile(r"Starting Spark master at (spark://[0-9.]+:[0-9]+)")


def spark_home() -> Path:
    """The installed pyspark package directory, which is a SPARK_HOME."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


class _Output(threading.Thread):
    """Copies a process's output to a file; `wait_for` waits for a matching line."""

    def __init__(self, process: subprocess.Popen[bytes], log: Path) -> None:
        super().__init__(daemon=True)
        self._process = process
        self._log = log
        self._lines: list[str] = []
        self._changed = threading.Condition()

    def run(self) -> None:
        """Run."""
        assert self._process.stdout is not None
        with open(self._log, "wb") as handle:
            for raw in self._process.stdout:
                handle.write(raw)
                handle.flush()
                with self._changed:
                    self._lines.append(raw.decode("utf-8", "replace"))
                    self._changed.notify_all()
        with self._changed:
            self._lines.append("")  # end of output
            self._changed.notify_all()

    def wait_for(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
        """Wait for."""
        seen = 0

        def found_or_ended() -> bool:
            """Found or ended."""
            return len(self._lines) > seen

        with self._changed:
            while True:
                for line in self._lines[seen:]:
                    found = pattern.search(line)
                    if found:
                        return found
                    if line == "":
                        raise RuntimeError(f"{self._log.name}: ended without {pattern.pattern!r}")
                seen = len(self._lines)
                if not self._changed.wait_for(found_or_ended, timeout):
                    raise RuntimeError(f"{self._log.name}: no {pattern.pattern!r} in {timeout} s")


class StandaloneCluster:
    """One master and one worker with ``cores`` cores, logging under ``directory``."""

    def __init__(self, directory: Path, cores: int = 2, memory: str = "2g") -> None:
        self.directory = directory
        self.cores = cores
        self.memory = memory
        self.url = ""
        self._processes: list[subprocess.Popen[bytes]] = []

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SPARK_HOME"] = str(spark_home())
        env["SPARK_LOCAL_IP"] = "127.0.0.1"
        env["SPARK_LOG_DIR"] = str(self.directory)
        env["SPARK_WORKER_DIR"] = str(self.directory / "work")
        return env

    def _start(self, name: str, arguments: list[str]) -> _Output:
        process = subprocess.Popen(
            [str(spark_home() / "bin" / "spark-class"), *arguments],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self._environment(),
            start_new_session=True,
        )
        self._processes.append(process)
        output = _Output(process, self.directory / f"{name}.log")
        output.start()
        return output

    def start(self) -> StandaloneCluster:
        """Start the master, then the worker; return once the worker registered."""
        self.directory.mkdir(parents=True, exist_ok=True)
        properties = self.directory / "spark.properties"
        properties.write_text("spark.master.rest.enabled false\nspark.ui.enabled false\n")
        common = ["--host", "127.0.0.1", "--port", "0", "--webui-port", "0"]
        common += ["--properties-file", str(properties)]
        try:
            master = self._start("master", ["org.apache.spark.deploy.master.Master", *common])
            self.url = master.wait_for(_MASTER_URL, START_TIMEOUT_SECONDS).group(1)
            worker = self._start(
                "worker",
                [
                    "org.apache.spark.deploy.worker.Worker",
                    self.url,
                    *common,
                    "--cores",
                    str(self.cores),
                    "--memory",
                    self.memory,
                    "--work-dir",
                    str(self.directory / "work"),
                ],
            )
            worker.wait_for(
                re.compile("Successfully registered with master"), START_TIMEOUT_SECONDS
            )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the worker and the master (their whole process groups)."""
        for process in reversed(self._processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in reversed(self._processes):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self._processes.clear()
