"""Tar shards read without Python's ``tarfile``: the headers parsed here (ustar, GNU and pax: what
Python's ``tarfile``, GNU tar and webdataset's writer produce), ten times faster per member.

With ``data.decode=gpu`` a loader worker only reads each sample's bytes and the JPEG's header, and
``webdataset.tarfile_to_samples`` (two ``tarfile`` headers parsed in Python per member, a pax one
and the member's) would be most of its work (docs/performance.md). Local, uncompressed shards go
through ``tar_samples`` here; streams (``pipe:``, ``scheme://``) and compressed tars still go
through webdataset. Samples are grouped as webdataset groups them, and a damaged shard reaches the
same handler with its URL as the error's last argument.
"""

from __future__ import annotations

import io
import os
import re
import tarfile
from collections.abc import Callable, Iterable, Iterator

import webdataset as wds

from .urls import _KEY as SAMPLE_KEY
from .urls import is_remote

BLOCK = tarfile.BLOCKSIZE
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta: "__key__"-like names are not fields
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")  # gzip, bzip2, xz, zstd


def tar_members(chunk: bytes) -> Iterator[tuple[str, bytes]]:
    """``(name, data)`` of each regular file in ``chunk``, whole tar records. Raises
    ``tarfile.ReadError`` on a damaged record."""
    return tar_records(io.BytesIO(chunk).read, whole=False)


def tar_records(read: Callable[[int], bytes], chunk_bytes: int = 8 << 20,
                whole: bool = True) -> Iterator[tuple[str, bytes]]:
    """``(name, data)`` of each regular file of the tar that ``read(n)`` returns the bytes of, in
    order, reading ``chunk_bytes`` at a time (a member's data is one slice of them). Ends at the
    end-of-archive blocks; raises ``tarfile.ReadError`` on a bad header checksum, a member cut
    short, or (``whole``: a whole tar file, not a run of its records) bytes that end before the
    end-of-archive blocks (a file cut short between two members)."""
    buffer, at, ended = b"", 0, False
    long_name, pax = None, {}

    def have(count: int) -> bool:  # at least count bytes from at, reading more as needed
        nonlocal buffer, at, ended
        while len(buffer) - at < count and not ended:
            more = read(max(chunk_bytes, count + at - len(buffer)))
            ended = not more
            if at >= len(buffer):  # at is past what was read (a member's padding): skip into the new bytes
                buffer, at = more, at - len(buffer)
            else:
                buffer, at = buffer[at:] + more, 0
        return len(buffer) - at >= count

    while have(BLOCK):
        header = buffer[at:at + BLOCK]
        if header.count(0) == BLOCK:
            return  # the end-of-archive blocks
        if not _checksum_holds(header):
            raise tarfile.ReadError("bad tar header checksum")
        kind = header[156:157]
        size = int(pax.get("size", _octal(header[124:136])))
        if not have(BLOCK + size):
            raise tarfile.ReadError("tar member cut short")
        data = buffer[at + BLOCK:at + BLOCK + size]
        at += BLOCK + -(-size // BLOCK) * BLOCK  # past the padding (a missing tail of it ends the loop)
        if kind == b"x":  # pax extended header: applies to the next member
            pax = _pax_records(data)
        elif kind == b"L":  # GNU long name of the next member
            long_name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif kind in (b"0", b"\0", b"7"):
            yield pax.get("path") or long_name or _ustar_name(header), data
            long_name, pax = None, {}
        elif kind != b"g":  # directories, links and the rest carry no sample field
            long_name, pax = None, {}
    if whole or buffer[at:].count(0) != len(buffer) - at:
        raise tarfile.ReadError("tar cut short: no end-of-archive blocks" if whole else "tar header cut short")


class NotPlain(Exception):
    """A tar ``tar_headers`` does not read exactly as ``tarfile`` would (compressed, a link, a sparse file, a global
    pax header, a bad checksum or number, a cut): ``tarfile``'s to read."""


def tar_headers(path: str | os.PathLike) -> Iterator[tuple[str, int, int]]:
    """Each regular member of the tar at ``path``, read from the headers alone (seeking past the data, ten times
    faster than ``tarfile``): its name, the offset of its first header (its extended ones included, as
    ``tarfile``'s ``TarInfo.offset``) and the end of its data padded to a block; as ``tarfile`` names and orders
    them. Ends at the end-of-archive blocks or the file's end between members; raises ``NotPlain`` where only
    ``tarfile`` can say (then it is asked, and decides as it always did)."""
    with open(path, "rb") as handle:
        total, at, first = os.fstat(handle.fileno()).st_size, 0, None
        long_name, pax = None, {}
        while at < total:
            handle.seek(at)
            header = handle.read(BLOCK)
            if len(header) < BLOCK:
                raise NotPlain("a header cut short")
            if header.count(0) == BLOCK:
                return  # the end-of-archive blocks
            try:
                size = int(pax.get("size", _octal(header[124:136])))
                if not _checksum_holds(header) or size < 0:
                    raise NotPlain("a bad header checksum")
            except (tarfile.ReadError, ValueError):
                raise NotPlain("a bad number field") from None
            end = at + BLOCK + -(-size // BLOCK) * BLOCK
            if end > total:
                raise NotPlain("a member cut short")
            kind, first = header[156:157], at if first is None else first
            if kind in (b"x", b"L"):  # the next member's pax records, or its GNU long name
                data = handle.read(size)
                if kind == b"x":
                    try:
                        pax = _pax_records(data)
                    except ValueError:
                        raise NotPlain("bad pax records") from None
                    if any(key.startswith("GNU.sparse") for key in pax):  # the data is a sparse map, then the file
                        raise NotPlain("a sparse member")
                else:
                    long_name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            elif kind in (b"0", b"\0", b"7", b"5"):
                name = pax.get("path") or long_name or _ustar_name(header)
                if kind != b"5" and not (kind == b"\0" and name.endswith("/")):  # (tarfile: that one is a folder)
                    yield name, first, end
                long_name, pax, first = None, {}, None
            else:  # links, devices, sparse files, global pax headers
                raise NotPlain(f"a member of type {kind!r}")
            at = end


def tarfile_members(path: str | os.PathLike, mode: str) -> tuple[list[tuple[str, int, int]], BaseException | None]:
    """``tarfile``'s reading (``mode``: ``"r:"``, or ``"r:*"`` for compressed tars too) of the tar's regular members, as
    ``tar_headers`` yields them (name, first header's offset, padded end of the data), headers only; and the error that
    ended the reading early (damage; a sparse member whose map does not parse raises ``ValueError``), else None."""
    members, error = [], None
    try:
        with tarfile.open(path, mode) as tar:
            while (member := tar.next()) is not None:
                if member.isfile():
                    members.append((member.name, member.offset, member.offset_data + -(-member.size // BLOCK) * BLOCK))
                tar.members.clear()  # headers only: keep no TarInfo per member
    except (tarfile.TarError, EOFError, OSError, ValueError) as failed:
        error = failed
    return members, error


def sample_starts(members: Iterable[tuple[str, int, int]]) -> tuple[list[int], int]:
    """The offset of each sample's first member, and the end of the last sample's last member, of ``members`` (``tar_
    headers``' or ``tarfile_members``'): consecutive members sharing the name up to the first dot of the file name are
    one sample (webdataset's grouping); members without such a name are no sample's."""
    starts, last, end = [], None, 0
    for name, offset, member_end in members:
        match = SAMPLE_KEY.match(name)
        if match:
            if match.group(1) != last:
                starts.append(offset)
                last = match.group(1)
            end = member_end
    return starts, end


def _checksum_holds(header: bytes) -> bool:
    """The header's checksum: the sum of its bytes with the checksum field's eight as spaces (raises
    ``tarfile.ReadError`` where the field is not a number)."""
    return sum(header) - sum(header[148:156]) + 8 * 32 == _octal(header[148:156])


def _ustar_name(header: bytes) -> str:
    """A header's own name, its ustar prefix before it, each cut at its first NUL (as ``tarfile`` reads them)."""
    name, prefix = header[:100].split(b"\0", 1)[0], header[345:500].split(b"\0", 1)[0]
    return (prefix + b"/" + name if prefix else name).decode("utf-8", "surrogateescape")


def _octal(field: bytes) -> int:
    if field[:1] in (b"\x80", b"\xff"):  # GNU base-256 for large sizes
        return int.from_bytes(field[1:], "big") * (-1 if field[:1] == b"\xff" else 1)
    digits = field.rstrip(b" \0")
    try:
        return int(digits or b"0", 8)
    except ValueError:
        raise tarfile.ReadError(f"bad number field {field!r}") from None


def _pax_records(data: bytes) -> dict[str, str]:
    """A pax header's ``length key=value\\n`` records."""
    records, at = {}, 0
    while at < len(data) and data[at:at + 1] != b"\0":
        length = int(data[at:data.index(b" ", at)])
        key, _, value = data[data.index(b" ", at) + 1:at + length - 1].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        at += length
    return records


def sample_key(name: str) -> tuple[str, str] | None:
    """webdataset's grouping of a member name: ``(key, field)``, the path up to the first dot of the
    file name and the rest of it, lower-cased; ``None`` for a name without one, or a metadata name."""
    match = None if _META.match(name) else SAMPLE_KEY.match(name)
    if match is None:
        return None
    key = match.group(1)
    return key, name[len(key) + 1:].lower()


def _local_path(url: str) -> str:
    return os.path.expanduser(url.removeprefix("file:"))


def reads_locally(url: str) -> bool:
    """A local, uncompressed tar (``tar_samples`` reads it here; anything else goes to webdataset)."""
    if is_remote(url):
        return False
    try:
        with open(_local_path(url), "rb") as handle:
            return not handle.read(6).startswith(_COMPRESSED)
    except OSError:
        return True  # missing or unreadable: the reader raises it, and the handler counts it


def _webdataset_samples(source: dict, handler: Callable[[Exception], bool]) -> Iterator[dict]:
    """One shard through webdataset's reader, its errors given to ``handler`` as ``tar_samples``
    gives its own: once per damaged shard, with the URL last. webdataset reports an error inside a
    member with only the stream (``"message @ <stream>"``), then the shard's own error with
    ``(message, stream, url)``; the first is held and given, as the cause, with the second. (A
    member error that no shard error follows leaves its sample without that field, which the
    decoding counts.)"""
    held: list[str] = []

    def shard_errors(error: Exception) -> bool:
        message = str(error.args[0]) if error.args else ""
        if len(error.args) == 1 and " @ " in message:  # inside a member: the shard's own error follows
            held.append(message.rpartition(" @ ")[0])
            return True
        if held and len(error.args) >= 3:  # (message, stream, url)
            error.args = (held.pop(0), *error.args[1:])
        return handler(error)

    yield from wds.tarfile_to_samples(handler=shard_errors)(iter([source]))


def tar_samples(handler: Callable[[Exception], bool]) -> Callable[[Iterable[dict]], Iterator[dict]]:
    """``webdataset.tarfile_to_samples(handler=handler)``'s like: from ``{"url": ...}`` sources, the
    samples ``{"__key__", "__url__", field: bytes, ...}`` of each shard in turn. An error reading a
    shard (a bad header, a member cut short, a missing file) goes to ``handler`` with the URL as the
    error's last argument; the samples read before it are kept (the last one perhaps missing fields),
    and the next shard is read if the handler returns true."""

    def samples(sources: Iterable[dict]) -> Iterator[dict]:
        for source in sources:
            url = source["url"]
            if not reads_locally(url):
                yield from _webdataset_samples(source, handler)
                continue
            current = None
            try:
                with open(_local_path(url), "rb", buffering=0) as handle:
                    for name, data in tar_records(handle.read):
                        grouped = sample_key(name)
                        if grouped is None:
                            continue
                        key, field = grouped
                        if current is None or key != current["__key__"] or field in current:
                            if current is not None:
                                yield current
                            current = {"__key__": key, "__url__": url}
                        current[field] = data
            except (tarfile.TarError, OSError, ValueError) as error:
                error.args = (*error.args, url)
                if current is not None:
                    yield current
                if handler(error):
                    continue
                raise
            if current is not None:
                yield current

    return samples
