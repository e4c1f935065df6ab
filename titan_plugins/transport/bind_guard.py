"""Keep Mooncake's listening sockets on the job's interface.

Mooncake Transfer Engine binds its listeners to the wildcard address, whatever it is told:
``findAvailableTcpPort`` (the RPC / P2P-handshake port, ``transfer_metadata_plugin.cpp``) binds
``INADDR_ANY`` / ``in6addr_any`` and the TCP transport's data acceptor (``TcpContext`` in
``tcp_transport_session_impl.h``) binds ``[::]`` dual-stack. ``MC_TCP_BIND_ADDRESS`` only sets
the address *advertised* in the metadata-server RPC mode; no variable changes what is bound. So a
job that talks over 127.0.0.1 would still be reachable on every interface of the host.

While the engine initialises, :func:`confined_binds` points the ``bind`` import of Mooncake's
own shared objects (their GOT slots) at a function that replaces a wildcard address with the
job's address, then puts the original back; nothing else in the process is affected.
:func:`wildcard_listeners` then checks the outcome from ``/proc``: the caller refuses the engine
if any listener it opened is still on the wildcard.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import mmap
import os
import socket
import struct
from collections.abc import Iterator
from typing import Any

from titan_plugins.transport.addresses import local_address
from titan_plugins.values import shown_value

_AF_INET, _AF_INET6 = socket.AF_INET, socket.AF_INET6
_RELOCS = {62: (6, 7), 183: (1025, 1026)}  # e_machine: (GLOB_DAT, JUMP_SLOT), x86-64 / aarch64
_RTLD_DI_LINKMAP = 2
_BIND = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32)
_KEEP: list[object] = []  # hooks stay alive for good: a thread could still be inside one


class BindGuardError(RuntimeError):
    """The listeners could not be confined (the caller then does not use Mooncake)."""


def _import_slots(path: str, symbol: str) -> list[int]:
    """Offsets (from the load base) of the GOT slots through which ``path`` calls ``symbol``."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _find_slots(path, data, symbol.encode())


def _aligned_find(data: Any, needle: bytes, start: int, end: int, entry: int, at: int) -> list[int]:
    """Offsets of ``needle`` in ``data[start:end]`` that sit at byte ``at`` of an entry."""
    found, pos = [], data.find(needle, start, end)
    while pos != -1:
        if (pos - start) % entry == at:
            found.append(pos - at)
        pos = data.find(needle, pos + 1, end)
    return found


def _find_slots(path: str, data: Any, symbol: bytes) -> list[int]:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise BindGuardError(f"{path}: not a 64-bit little-endian ELF file")
    machine = struct.unpack_from("<H", data, 18)[0]
    if machine not in _RELOCS:
        raise BindGuardError(f"{path}: unsupported machine {machine}")
    (shoff,) = struct.unpack_from("<Q", data, 40)
    shentsize, shnum = struct.unpack_from("<HH", data, 58)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    slots = []
    for dynsym_index, dynsym in enumerate(sections):
        if dynsym[1] != 11:  # SHT_DYNSYM: 24-byte entries, st_name first
            continue
        strtab = sections[dynsym[6]]
        # Every place the name could start (linkers share string tails: "bind" may be the end
        # of a longer name), then the symbols whose st_name is one of them.
        entries = [
            entry
            for at in _aligned_find(data, symbol + b"\0", strtab[4], strtab[4] + strtab[5], 1, 0)
            for entry in _aligned_find(
                data, struct.pack("<I", at - strtab[4]), dynsym[4], dynsym[4] + dynsym[5], 24, 0
            )
        ]
        for entry in entries:
            index = (entry - dynsym[4]) // 24
            for sh in sections:
                if sh[1] != 4 or sh[6] != dynsym_index:  # SHT_RELA against this table
                    continue
                for rel_type in _RELOCS[machine]:  # Elf64_Rela: r_offset, r_info, r_addend
                    needle = struct.pack("<Q", index << 32 | rel_type)
                    for rela in _aligned_find(data, needle, sh[4], sh[4] + sh[5], 24, 8):
                        slots.append(struct.unpack_from("<Q", data, rela)[0])
    return sorted(slots)


def _load_base(path: str) -> int:
    """Load bias of an already-loaded shared object (``dlinfo(RTLD_DI_LINKMAP)->l_addr``)."""
    handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)._handle
    linkmap = ctypes.c_void_p()
    if ctypes.CDLL(None).dlinfo(ctypes.c_void_p(handle), _RTLD_DI_LINKMAP, ctypes.byref(linkmap)):
        raise BindGuardError(f"dlinfo failed for {path}")
    return ctypes.c_size_t.from_address(linkmap.value).value


def _page_protection(addr: int) -> int:
    for line in open("/proc/self/maps"):
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= addr < hi:
            return (1 if perms[0] == "r" else 0) | (2 if perms[1] == "w" else 0)
    raise BindGuardError(f"address {addr:#x} is not mapped")


def _write_pointer(libc: ctypes.CDLL, slot: int, value: int) -> int:
    """Store ``value`` in the GOT ``slot`` (made writable for the moment); return the old one."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = slot & ~(page - 1)
    protection = _page_protection(slot)
    mprotect = libc.mprotect
    mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if not protection & 2 and mprotect(start, page, 3):
        raise BindGuardError(f"mprotect of the GOT page at {start:#x} failed")
    cell = ctypes.c_void_p.from_address(slot)
    old = cell.value or 0
    cell.value = value
    if not protection & 2:
        mprotect(start, page, protection)
    return old


def mooncake_libraries() -> list[str]:
    """The loaded shared objects of the Mooncake wheel (its package and bundled-library dirs)."""
    import mooncake

    package = os.path.dirname(os.path.realpath(mooncake.__file__))
    roots = (package + os.sep, os.path.dirname(package) + os.sep + "mooncake")
    paths = set()
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith(roots) and ".so" in fields[5]:
            paths.add(fields[5])
    return sorted(paths)


def _address_bytes(host: str) -> tuple[bytes | None, bytes]:
    """(IPv4 bytes or None, IPv6 bytes: the address itself, or IPv4-mapped) of ``host``, the
    first of its addresses that is this host's.

    :raises BindGuardError: ``host`` does not resolve, or is not an address of this host.
    """
    try:
        found = local_address(host)
    except ValueError as err:  # a raw socket.gaierror named neither the host nor the fix
        raise BindGuardError(f"the job's address {shown_value(host)} {err}") from None
    ip = ipaddress.ip_address(found.split("%", 1)[0])  # an IPv6 scope (fe80::1%eth0) aside
    if ip.version == 4:
        return ip.packed, ipaddress.IPv6Address(f"::ffff:{ip}").packed
    return None, ip.packed


def _make_hook(libc: ctypes.CDLL, host: str) -> object:
    ip4, ip6 = _address_bytes(host)
    real_bind = libc.bind
    real_bind.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
    errno_location = libc.__errno_location
    errno_location.restype = ctypes.c_void_p

    def bind(fd: int, addr: int, addrlen: int) -> int:
        raw = ctypes.string_at(addr, addrlen)
        family = struct.unpack_from("=H", raw)[0]
        if family == _AF_INET and addrlen >= 8 and raw[4:8] == bytes(4):
            if ip4 is None:  # an IPv6 job address cannot take an IPv4 wildcard: refuse
                ctypes.c_int.from_address(errno_location()).value = 99  # EADDRNOTAVAIL
                return -1
            raw = raw[:4] + ip4 + raw[8:]
        elif family == _AF_INET6 and addrlen >= 24 and raw[8:24] == bytes(16):
            raw = raw[:8] + ip6 + raw[24:]
        return real_bind(fd, raw, addrlen)

    return _BIND(bind)


@contextlib.contextmanager
def confined_binds(host: str) -> Iterator[None]:
    """Inside the block, Mooncake's wildcard binds go to ``host`` instead."""
    libc = ctypes.CDLL(None)
    hook = _make_hook(libc, host)
    _KEEP.append(hook)
    target = ctypes.cast(hook, ctypes.c_void_p).value or 0
    patched: list[tuple[int, int]] = []
    try:
        for path in mooncake_libraries():
            slots = _import_slots(path, "bind")
            if slots:
                base = _load_base(path)
                patched += [(base + s, _write_pointer(libc, base + s, target)) for s in slots]
        if not patched:
            raise BindGuardError("no Mooncake library imports bind(): unknown wheel layout")
        yield
    finally:
        for slot, old in reversed(patched):
            _write_pointer(libc, slot, old)


def listening_sockets() -> dict[int, str]:
    """``{inode: "address:port"}`` of this process's listening TCP sockets (from ``/proc``)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    found = {}
    for table, family in (("/proc/net/tcp", _AF_INET), ("/proc/net/tcp6", _AF_INET6)):
        with contextlib.suppress(OSError), open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                inode = int(fields[9])
                if fields[3] != "0A" or inode not in inodes:  # 0A: LISTEN
                    continue
                hex_addr, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_addr)
                # /proc prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found[inode] = f"{socket.inet_ntop(family, raw)}:{int(hex_port, 16)}"
    return found


def is_wildcard(local: str) -> bool:
    """Whether a ``listening_sockets`` address is a wildcard (every interface)."""
    host = local.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a host name: a specific interface
        return False
