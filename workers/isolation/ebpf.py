"""libbpf through ctypes: open and load the compiled isolation programs, attach them to a cgroup,
fill their maps and read their counters.

Programs are attached with BPF links owned by this process: when it exits, however it exits, the
kernel detaches them, so a crashed worker never leaves programs that silently drop traffic.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from pathlib import Path

from reflow.addresses import Network

# program -> where it attaches (enum bpf_attach_type)
PROGRAMS = {
    "reflow_ingress": 0,  # BPF_CGROUP_INET_INGRESS
    "reflow_connect4": 10,  # BPF_CGROUP_INET4_CONNECT
    "reflow_connect6": 11,  # BPF_CGROUP_INET6_CONNECT
    "reflow_sendmsg4": 14,  # BPF_CGROUP_UDP4_SENDMSG
    "reflow_sendmsg6": 15,  # BPF_CGROUP_UDP6_SENDMSG
}
COUNTERS = ("ingress_admitted", "ingress_dropped", "egress_allowed", "egress_denied")
BPF_ANY = 0
LIBBPF_DEBUG = 2  # libbpf's most verbose level: left out of error messages
LOG_LINES = 40  # the end of libbpf's log (the verifier's complaint is at its end) kept in errors


class BpfError(RuntimeError):
    """The kernel or libbpf refused: the message says what, with the verifier's log if any."""


@functools.cache
def _libbpf() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
    except OSError as error:
        raise BpfError(
            f"libbpf.so.1 not found ({error}); install libbpf1 (Debian/Ubuntu: apt install libbpf1)"
        ) from None
    p = ctypes.c_void_p
    for name, restype, argtypes in (
        ("bpf_object__open_file", p, [ctypes.c_char_p, p]),
        ("bpf_object__load", ctypes.c_int, [p]),
        ("bpf_object__close", None, [p]),
        ("bpf_object__find_program_by_name", p, [p, ctypes.c_char_p]),
        ("bpf_object__find_map_by_name", p, [p, ctypes.c_char_p]),
        ("bpf_program__attach_cgroup", p, [p, ctypes.c_int]),
        ("bpf_link__destroy", ctypes.c_int, [p]),
        ("bpf_map__fd", ctypes.c_int, [p]),
        ("bpf_map_update_elem", ctypes.c_int, [ctypes.c_int, p, p, ctypes.c_uint64]),
        ("bpf_map_lookup_elem", ctypes.c_int, [ctypes.c_int, p, p]),
        ("libbpf_num_possible_cpus", ctypes.c_int, []),
        ("libbpf_set_print", p, [p]),
        ("bpf_prog_query", ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_uint32, p, p, p]),
    ):
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


_PRINT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


class _Log:
    """Collects libbpf's messages (the verifier's log among them) instead of printing them."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._libc = ctypes.CDLL(ctypes.util.find_library("c"))
        self._libc.vasprintf.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_char_p, ctypes.c_void_p]
        self._libc.free.argtypes = [ctypes.c_void_p]
        self.callback = _PRINT(self._collect)

    def _collect(self, level: int, fmt: bytes, args: int) -> int:
        if level >= LIBBPF_DEBUG:
            return 0
        text = ctypes.c_char_p()
        if self._libc.vasprintf(ctypes.byref(text), fmt, args) >= 0:  # the whole message, however long
            self.lines += (text.value or b"").decode(errors="replace").splitlines()
            self._libc.free(ctypes.cast(text, ctypes.c_void_p))
        del self.lines[:-LOG_LINES]
        return 0

    def tail(self) -> str:
        """The last messages, then forgets them."""
        text = "\n".join(line for line in self.lines if line.strip())
        self.lines.clear()
        return text


_LOG = _Log()  # one for the process: libbpf keeps calling the callback it was given


class IsolationPrograms:
    """The loaded isolation object, attached to one cgroup while open."""

    def __init__(self, object_path: Path, cgroup_dir: Path):
        self.lib = _libbpf()
        self.log = _LOG
        self.lib.libbpf_set_print(ctypes.cast(self.log.callback, ctypes.c_void_p))
        self._links: list[int] = []
        self._object = self.lib.bpf_object__open_file(str(object_path).encode(), None)
        if not self._object:
            raise BpfError(f"cannot open {object_path}: {os.strerror(ctypes.get_errno())}\n{self.log.tail()}")
        try:
            if self.lib.bpf_object__load(self._object) != 0:
                raise BpfError(
                    f"the kernel refused the isolation programs ({os.strerror(ctypes.get_errno())}):\n"
                    f"{self.log.tail()}"
                )
            self._attach(cgroup_dir)
            self._counters = self._map_fd("counters"), self.lib.libbpf_num_possible_cpus()
        except BaseException:
            self.close()
            raise

    def _attach(self, cgroup_dir: Path) -> None:
        fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name in PROGRAMS:
                program = self.lib.bpf_object__find_program_by_name(self._object, name.encode())
                if not program:
                    raise BpfError(
                        f"the isolation object has no program {name!r}: rebuild it with `make bpf`"
                    )
                link = self.lib.bpf_program__attach_cgroup(program, fd)
                if not link:
                    raise BpfError(
                        f"attaching {name} to {cgroup_dir} failed: {os.strerror(ctypes.get_errno())}"
                    )
                self._links.append(link)
        finally:
            os.close(fd)

    def _map_fd(self, name: str) -> int:
        found = self.lib.bpf_object__find_map_by_name(self._object, name.encode())
        if not found:
            raise BpfError(f"the isolation object has no map {name!r}")
        return self.lib.bpf_map__fd(found)

    def _update(self, name: str, key: bytes, value: bytes) -> None:
        key_buffer, value_buffer = (
            ctypes.create_string_buffer(key, len(key)),
            ctypes.create_string_buffer(value, len(value)),
        )
        if self.lib.bpf_map_update_elem(self._map_fd(name), key_buffer, value_buffer, BPF_ANY) != 0:
            raise BpfError(f"updating map {name} failed: {os.strerror(ctypes.get_errno())}")

    def allow_cgroup(self, cgroup_id: int) -> None:
        """Admits new connections from sockets of this cgroup (same host)."""
        self._update("allowed_cgroups", cgroup_id.to_bytes(8, sys.byteorder), b"\x01")

    def open_port(self, port: int) -> None:
        """Anyone may open a connection to this port (every other one is guarded)."""
        self._update("open_ports", port.to_bytes(2, sys.byteorder), b"\x01")

    def allow_source(self, network: Network) -> None:
        """Admits new connections from these addresses (other hosts)."""
        name = "sources_v4" if network.version == 4 else "sources_v6"
        key = network.prefixlen.to_bytes(4, sys.byteorder) + network.network_address.packed
        self._update(name, key, b"\x01")

    def allow_destination(self, network: Network, port: int = 0) -> None:
        """Lets the worker connect to these addresses, on `port` (0 = any)."""
        name = "destinations_v4" if network.version == 4 else "destinations_v6"
        prefix = (16 + network.prefixlen).to_bytes(4, sys.byteorder)
        key = prefix + port.to_bytes(2, "big") + network.network_address.packed
        self._update(name, key, b"\x01")

    def counters(self) -> dict[str, int]:
        """The counters summed over CPUs."""
        fd, cpus = self._counters
        values = (ctypes.c_uint64 * cpus)()  # per call: a scrape and a Status may read at once
        totals = {}
        for index, name in enumerate(COUNTERS):
            key = ctypes.c_uint32(index)
            if self.lib.bpf_map_lookup_elem(fd, ctypes.byref(key), values) != 0:
                raise BpfError(f"reading counter {name} failed: {os.strerror(ctypes.get_errno())}")
            totals[name] = sum(values)
        return totals

    def close(self) -> None:
        """Detaches the programs and frees the object."""
        for link in self._links:
            self.lib.bpf_link__destroy(link)
        self._links.clear()
        if self._object:
            self.lib.bpf_object__close(self._object)
            self._object = None


def attached_programs(cgroup_dir: Path) -> int:
    """How many programs are attached to `cgroup_dir` at the isolation hooks (any owner)."""
    lib = _libbpf()
    fd = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        total = 0
        for attach_type in PROGRAMS.values():
            flags, count = ctypes.c_uint32(0), ctypes.c_uint32(0)
            if lib.bpf_prog_query(fd, attach_type, 0, ctypes.byref(flags), None, ctypes.byref(count)) != 0:
                raise BpfError(f"querying {cgroup_dir} failed: {os.strerror(ctypes.get_errno())}")
            total += count.value
        return total
    finally:
        os.close(fd)
