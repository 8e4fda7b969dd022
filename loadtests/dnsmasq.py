"""A real DNS server for the tests and benchmarks: Debian's dnsmasq on a loopback port, its
records in files.

Names under `.test` are answered from the server's own records only (`--local`): a name it
does not know is NXDOMAIN, a known name without AAAA records gets an empty answer. A records
come from a hosts file, re-read on SIGHUP (`set_hosts`, which waits until the server answers
with the new records). SRV records are command-line options, which dnsmasq reads only when it
starts: `set_srv` restarts it on the same port (held for the server's whole life, so nothing
takes it in between). `pause` (SIGSTOP) leaves queries unanswered, as a dead resolver does.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import dns.exception
import dns.nameserver
import dns.resolver

from loadtests.ports import hold_port
from loadtests.procs import terminate

DNSMASQ = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"
STARTUP_S = 10.0


class DnsServer:
    def __init__(self, workdir: Path, ttl_s: int = 1) -> None:
        self.hosts_file = workdir / "dns-hosts"
        self.hosts_file.write_text("")
        self.ttl_s = ttl_s
        self._hold = hold_port()
        self.port = self._hold.port
        self.address = f"127.0.0.1:{self.port}"
        self._srv: dict[str, list[tuple[str, int, str]]] = {}  # name -> (target, port, address)
        self._hosts: dict[str, list[str]] = {}
        self._proc: subprocess.Popen[str] | None = None
        self._paused = False
        try:
            self._start()
        except BaseException:
            self._hold.close()
            raise

    def _argv(self) -> list[str]:
        argv = [
            DNSMASQ,
            "--keep-in-foreground",
            "--conf-file=/dev/null",  # nothing from the machine's configuration
            "--no-resolv",
            "--no-hosts",
            f"--addn-hosts={self.hosts_file}",
            "--local=/test/",
            "--listen-address=127.0.0.1",
            "--bind-interfaces",
            f"--port={self.port}",
            f"--local-ttl={self.ttl_s}",
            "--user=root",
            "--pid-file=",
            "--log-facility=-",
        ]
        for name, records in self._srv.items():
            for target, port, address in records:
                argv.append(f"--srv-host={name},{target},{port}")
                argv.append(f"--host-record={target},{address}")
        return argv

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            self._argv(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        deadline = time.monotonic() + STARTUP_S
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"dnsmasq exited with {self._proc.returncode}")
            try:
                self.query("ready.invalid.test", "A")
                return
            except dns.exception.DNSException:
                if time.monotonic() > deadline:
                    raise RuntimeError("dnsmasq did not answer") from None
                time.sleep(0.05)

    def query(self, name: str, rdtype: str = "A") -> list[str]:
        """What the server answers now (NXDOMAIN: [])."""
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = [dns.nameserver.Do53Nameserver("127.0.0.1", self.port)]
        resolver.lifetime = 1.0
        try:
            answer = resolver.resolve(name, rdtype, raise_on_no_answer=False)
        except dns.resolver.NXDOMAIN:
            return []
        return sorted(record.to_text() for record in answer.rrset or ())

    def set_hosts(self, hosts: Mapping[str, Sequence[str]]) -> None:
        """Replace the A/AAAA records (name -> addresses); returns once the server answers
        with them."""
        self._hosts = {name: list(addresses) for name, addresses in hosts.items()}
        lines = [f"{a} {name}" for name, addresses in self._hosts.items() for a in addresses]
        self.hosts_file.write_text("".join(line + "\n" for line in lines))
        assert self._proc is not None
        self._proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + STARTUP_S
        for name, addresses in self._hosts.items():
            want = sorted(a for a in addresses if ":" not in a)
            while self.query(name, "A") != want:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"dnsmasq did not take the records of {name}")
                time.sleep(0.02)

    def set_srv(self, name: str, records: Sequence[tuple[str, int, str]]) -> None:
        """Replace the SRV records of `name`: (target, port, target's address) each. dnsmasq
        reads them only at start: it is restarted on the same port."""
        self._srv[name] = list(records)
        self._stop_process()
        self._start()

    def pause(self) -> None:
        """Stop answering (the process is stopped: queries time out)."""
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGCONT)
        self._paused = False

    def _stop_process(self) -> None:
        proc, self._proc = self._proc, None
        self._paused = False
        if proc is not None:
            terminate(proc, 5.0)  # resumed first, if paused

    def stop(self) -> None:
        try:
            self._stop_process()
        finally:
            self._hold.close()
