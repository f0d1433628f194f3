"""A bounds-checked reader of an LMDB data file that trusts none of its bytes.

LMDB has no page checksums and follows page numbers and node offsets as they are, so one
flipped byte in a meta, branch or leaf page can stop an environment from opening, fail a
scan, or send a read into another page. `check_file` walks the file the way LMDB would
(LMDB 0.9 format: 16-byte page headers, 8-byte nodes, 64-bit page numbers) and checks
everything LMDB relies on: both meta pages, page numbers and kinds, node bounds, key
order within the parent's separators, overflow headers, the free-page lists, the meta's
counts, and that every page is in exactly one place (tree, free list or meta). It returns
the values it could reach and the problems it found; a damaged subtree is skipped, never
read further. Values themselves are verified by their own checksums (values.py).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field

PAGE_HEADER = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper (lower/upper: pages count on overflow)
NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
DB = struct.Struct("<IHHQQQQQ")  # pad (psize on the free db), flags, depth, branch, leaf, overflow, entries, root
META = struct.Struct("<IIQQ")  # magic, version, address, mapsize
U64 = struct.Struct("<Q")
P_BRANCH, P_LEAF, P_OVERFLOW, P_META = 0x01, 0x02, 0x04, 0x08
F_BIGDATA = 0x01
MAGIC, VERSION, INTEGERKEY = 0xBEEFC0DE, 1, 0x08
NO_ROOT = (1 << 64) - 1
MAX_DEPTH = 32  # LMDB's CURSOR_STACK


@dataclass(slots=True)
class Meta:
    txnid: int
    last_pg: int
    free_db: tuple
    main_db: tuple


@dataclass
class FileReport:
    """What the walk found: reachable values (key -> (file offset, length)) and every problem."""

    path: str
    entries: dict[bytes, tuple[int, int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    expected_entries: int = 0
    txnid: int = 0

    @property
    def clean(self) -> bool:
        return not self.problems


class LmdbFile:
    """A read-only map of `<dir>/data.mdb`; `check()` walks it, `read()` returns checked ranges."""

    def __init__(self, env_dir: str) -> None:
        self.path = os.path.join(env_dir, "data.mdb")
        with open(self.path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else b""

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or offset + length > self.size:
            raise ValueError(f"{self.path}: bytes [{offset}, {offset + length}) lie outside the file")
        return self.map[offset: offset + length]

    def close(self) -> None:
        if isinstance(self.map, mmap.mmap):
            self.map.close()

    def check(self) -> FileReport:
        """Walk the newest valid meta's trees; if they are damaged, also the previous commit's, and keep the better."""
        problems: list[str] = []
        metas, psize = self._metas(problems)
        walks: list[FileReport] = []
        for meta in metas:
            walks.append(self._walk(meta, psize))
            if walks[-1].clean:
                break
        if not walks:
            return FileReport(self.path, problems=problems + ["no valid meta page: nothing can be read"])
        best = walks[-1] if walks[-1].clean else walks[0]  # a clean previous commit, else the newest
        if best is not walks[0]:
            problems.append(f"the newest commit (txn {walks[0].txnid}) leads to a damaged tree "
                            f"({walks[0].problems[0]}); reading the previous commit (txn {best.txnid})")
        best.problems[:0] = problems
        return best

    def _walk(self, meta: Meta, psize: int) -> FileReport:
        report = FileReport(self.path, txnid=meta.txnid, expected_entries=meta.main_db[6])
        if (meta.last_pg + 1) * psize > self.size:
            report.problems.append(f"meta says {meta.last_pg + 1} pages; the file holds {self.size // psize}")
            return report
        walk = _Walk(self, psize, meta.last_pg + 1, report)
        walk.tree("main", meta.main_db, walk.leaf_entry, bytes)  # LMDB's default order: memcmp, then length
        walk.tree("free", meta.free_db, walk.free_entry, _txnid)  # MDB_INTEGERKEY: native (little endian) u64
        walk.account()
        return report

    def _metas(self, problems: list[str]) -> tuple[list[Meta], int]:
        """The valid meta pages, newest first (LMDB's choice first), and the page size."""
        psize = mmap.PAGESIZE
        if self.size >= 40 + DB.size:  # the page size is stored in meta 0's free db record
            stored = DB.unpack_from(self.map, 40)[0]
            psize = stored if stored in (4096, 8192, 16384, 32768, 65536) else psize
        valid = []
        for i in (0, 1):
            meta, problem = self._meta(i, psize)
            if problem:
                problems.append(f"meta page {i}: {problem}")
            if meta is not None:
                valid.append(meta)
        if len(valid) == 2 and abs(valid[0].txnid - valid[1].txnid) != 1 and valid[0].txnid + valid[1].txnid:
            # One txnid is damaged. A later commit never has fewer pages, so the page count orders them first.
            problems.append(f"meta pages disagree: txnids {valid[0].txnid} and {valid[1].txnid}")
            return sorted(valid, key=lambda m: (-m.last_pg, -m.txnid)), psize
        return sorted(valid, key=lambda m: -m.txnid), psize

    def _meta(self, i: int, psize: int) -> tuple[Meta | None, str]:
        base = i * psize
        if self.size < base + 16 + META.size + 2 * DB.size + 16:
            return None, "missing (file too short)"
        pgno, _, flags, _, _ = PAGE_HEADER.unpack_from(self.map, base)
        magic, version, _, _ = META.unpack_from(self.map, base + 16)
        free_db, main_db = DB.unpack_from(self.map, base + 40), DB.unpack_from(self.map, base + 40 + DB.size)
        last_pg, txnid = struct.unpack_from("<QQ", self.map, base + 40 + 2 * DB.size)
        if pgno != i or flags != P_META or magic != MAGIC or version != VERSION:
            return None, "damaged header (page number, flags, magic or version)"
        if free_db[0] != psize or free_db[1] != INTEGERKEY or main_db[1] != 0 or main_db[0] != 0:
            return None, "damaged database flags or page size"
        if txnid and txnid % 2 != i:
            return None, f"txnid {txnid} cannot be on meta page {i}"
        if last_pg < 1 or any(db[7] != NO_ROOT and not 2 <= db[7] <= last_pg for db in (free_db, main_db)):
            return None, f"root or last page out of range (last page {last_pg})"
        return Meta(txnid, last_pg, free_db, main_db), ""


class _Walk:
    """One walk over the trees of one meta; every page it touches is marked in `owner`."""

    def __init__(self, file: LmdbFile, psize: int, num_pages: int, report: FileReport) -> None:
        self.file, self.map, self.psize, self.num_pages, self.report = file, file.map, psize, num_pages, report
        self.owner = bytearray(num_pages)  # 1 where a page is in a tree, a free list or a meta
        self.owner[0:2] = b"\x01\x01"
        self.counts: dict[str, list[int]] = {}  # db -> [depth, branch, leaf, overflow, entries]
        self.free_pages: list[int] = []

    def problem(self, text: str) -> None:
        self.report.problems.append(text)

    def claim(self, pgno: int, count: int, what: str) -> bool:
        if not 2 <= pgno or pgno + count > self.num_pages or count < 1:
            self.problem(f"{what}: pages [{pgno}, {pgno + count}) lie outside [2, {self.num_pages})")
            return False
        if self.owner.find(1, pgno, pgno + count) != -1:
            self.problem(f"{what}: page {pgno} is referenced twice")
            return False
        self.owner[pgno: pgno + count] = b"\x01" * count
        return True

    def tree(self, name: str, db: tuple, on_entry, order) -> None:
        depth, root = db[2], db[7]
        self.counts[name] = [0, 0, 0, 0, 0]
        if root == NO_ROOT:
            if db[2:7] != (0, 0, 0, 0, 0):
                self.problem(f"{name} db: empty, yet its meta counts {db[2:7]}")
            return
        self.counts[name][0] = depth
        if not 1 <= depth <= MAX_DEPTH:
            self.problem(f"{name} db: depth {depth} out of range")
            return
        self.page(name, root, depth, None, None, on_entry, order)
        if tuple(self.counts[name]) != db[2:7]:
            self.problem(f"{name} db: meta counts (depth, branch, leaf, overflow, entries) {db[2:7]}, "
                         f"the walk found {tuple(self.counts[name])}")

    def page(self, name: str, pgno: int, level: int, low, high, on_entry, order) -> None:
        """Check one page and recurse; `level` 1 is a leaf. Keys, as `order` ranks them, must lie in [low, high)."""
        what = f"{name} db page {pgno}"
        if not self.claim(pgno, 1, what):
            return
        base = pgno * self.psize
        stored_pgno, _, flags, lower, upper = PAGE_HEADER.unpack_from(self.map, base)
        kind = P_LEAF if level == 1 else P_BRANCH
        if stored_pgno != pgno or flags != kind:
            self.problem(f"{what}: header says page {stored_pgno} flags {flags:#x}, expected {kind:#x}; skipped")
            return
        if not (16 <= lower <= upper <= self.psize and lower % 2 == 0 and lower > 16):
            self.problem(f"{what}: lower/upper {lower}/{upper} are not a valid page; skipped")
            return
        self.counts[name][1 if level > 1 else 2] += 1
        nodes = self.nodes(what, base, (lower - 16) // 2, upper, level == 1)
        keys = [order(k) for _, k, _, _ in nodes]
        inner = keys[1:] if level > 1 else keys  # a branch page's first key is not compared (LMDB ignores it)
        if any(a >= b for a, b in zip(inner, inner[1:])) or (inner and low is not None and inner[0] < low) \
                or (inner and high is not None and inner[-1] >= high):
            self.problem(f"{what}: keys out of order or outside their parent's range")
        if level == 1:
            for offset, key, flags_, value in nodes:
                on_entry(what, offset, key, flags_, value)
            return
        bounds = [low] + keys[1:] + [high]
        for i, (_, _, _, child) in enumerate(nodes):
            self.page(name, child, level - 1, bounds[i], bounds[i + 1], on_entry, order)

    def nodes(self, what: str, base: int, count: int, upper: int, leaf: bool) -> list[tuple]:
        """(node offset, key, flags, data size or child pgno) of each node that lies inside its page."""
        out = []
        for i in range(count):
            ptr = struct.unpack_from("<H", self.map, base + 16 + 2 * i)[0]
            if not (upper <= ptr <= self.psize - NODE.size and ptr % 2 == 0):
                self.problem(f"{what}: node {i} at offset {ptr} lies outside the node area; node skipped")
                continue
            lo, hi, flags, ksize = NODE.unpack_from(self.map, base + ptr)
            start = base + ptr + NODE.size
            if leaf:
                dsize = lo | hi << 16
                inline = 8 if flags & F_BIGDATA else dsize
                if flags & ~F_BIGDATA or ptr + NODE.size + ksize + inline > self.psize:
                    self.problem(f"{what}: leaf node {i} (flags {flags:#x}, key {ksize} B, data {dsize} B) "
                                 "does not fit its page; node skipped")
                    continue
                out.append((start + ksize, self.map[start: start + ksize], flags, dsize))
            else:
                if ptr + NODE.size + ksize > self.psize:
                    self.problem(f"{what}: branch node {i} key of {ksize} B overruns its page; subtree skipped")
                    continue
                out.append((start, self.map[start: start + ksize], 0, lo | hi << 16 | flags << 32))
        return out

    def value(self, what: str, offset: int, flags: int, dsize: int, db: str) -> tuple[int, int] | None:
        """(file offset, length) of a leaf node's value, checking its overflow pages if it has them."""
        if not flags & F_BIGDATA:
            return offset, dsize
        (pgno,) = U64.unpack_from(self.map, offset)
        if not 2 <= pgno < self.num_pages:
            self.problem(f"{what}: value of {dsize} B points at page {pgno}, outside [2, {self.num_pages})")
            return None
        stored_pgno, _, ov_flags, lower, upper = PAGE_HEADER.unpack_from(self.map, pgno * self.psize)
        pages = lower | upper << 16  # LMDB keeps a run it overwrote in place with a smaller value: >= needed
        if stored_pgno != pgno or ov_flags != P_OVERFLOW or pages < (16 - 1 + dsize) // self.psize + 1:
            self.problem(f"{what}: overflow page {pgno} has a damaged header; its value is skipped")
            return None
        if not self.claim(pgno, pages, f"{what}: value of {dsize} B"):
            return None
        self.counts[db][3] += pages
        return pgno * self.psize + 16, dsize

    def leaf_entry(self, what: str, offset: int, key: bytes, flags: int, dsize: int) -> None:
        self.counts["main"][4] += 1
        place = self.value(what, offset, flags, dsize, "main")
        if place is None:
            return
        if key in self.report.entries:
            self.problem(f"{what}: key {key[:80]!r} appears twice; the second is skipped")
            return
        self.report.entries[key] = place

    def free_entry(self, what: str, offset: int, key: bytes, flags: int, dsize: int) -> None:
        self.counts["free"][4] += 1
        place = self.value(what, offset, flags, dsize, "free")
        if place is None:
            return
        start, length = place
        count = U64.unpack_from(self.map, start)[0] if length >= 8 else -1
        if len(key) != 8 or length % 8 or length < 8 * (count + 1):  # LMDB may reserve more than it fills
            self.problem(f"{what}: free-list record of {length} B does not hold {count} page numbers")
            return
        self.free_pages += struct.unpack_from(f"<{count}Q", self.map, start + 8)

    def account(self) -> None:
        """Tree pages, free pages and the two metas are every page below LMDB's next page, once each."""
        for pgno in self.free_pages:
            if not 2 <= pgno < self.num_pages or self.owner[pgno]:
                self.problem(f"free list: page {pgno} is out of range or also in use")
                return
            self.owner[pgno] = 1
        unaccounted = self.owner.count(0)
        if unaccounted:
            self.problem(f"{unaccounted} of {self.num_pages} pages are in no tree and no free list "
                         f"(first: page {self.owner.find(0)})")


def _txnid(key: bytes) -> int:
    return int.from_bytes(key, "little") if len(key) == 8 else -1  # a wrong length is reported per record


def check_file(env_dir: str) -> FileReport:
    """Walk `<env_dir>/data.mdb` (see the module docstring); never raises on damage, only on I/O errors."""
    file = LmdbFile(env_dir)
    try:
        return file.check()
    finally:
        file.close()
