#!/usr/bin/env python3
"""Extract Jane Austen's six novels as one UTF-8 text file, data/austen.txt.

The text comes from Debian's r-cran-janeaustenr package (public-domain novels,
MIT-licensed package): data/Rdata.rdb holds one zlib-compressed block per novel,
each a character vector (one element per line) in R's XDR serialisation format.
We read it with zlib + struct only, so neither R nor network beyond apt is needed.

    python3 scripts/extract_austen.py [--deb FILE.deb] [--out data/austen.txt]

Without --deb it runs `apt-get download r-cran-janeaustenr` in a temp directory.
Novels are written in publication order, lines joined with '\n', separated by
two blank lines. Reproducible: same package version -> same bytes.
"""
import argparse
import glob
import gzip
import hashlib
import os
import struct
import subprocess
import sys
import tempfile
import zlib

# Publication order (janeaustenr's austen_books() order).
NOVELS = ["sensesensibility", "prideprejudice", "mansfieldpark", "emma",
          "northangerabbey", "persuasion"]

# R SEXP types and special markers we may meet (R Internals, "Serialization Formats").
NILSXP, SYMSXP, LISTSXP, CHARSXP, INTSXP, REALSXP, STRSXP = 0, 1, 2, 9, 13, 14, 16
REFSXP, NILVALUE_SXP = 255, 254
IS_OBJECT, HAS_ATTR, HAS_TAG = 1 << 8, 1 << 9, 1 << 10
LATIN1_MASK, UTF8_MASK = 1 << 2, 1 << 3


class RReader:
    """Just enough of R's XDR unserialiser for vectors of strings and ints."""

    def __init__(self, buf):
        self.b, self.p, self.refs = buf, 0, []

    def int(self):
        (v,) = struct.unpack_from(">i", self.b, self.p)
        self.p += 4
        return v

    def header(self):
        if self.b[:2] != b"X\n":
            raise ValueError("not an R XDR serialisation (bad magic %r)" % self.b[:2])
        self.p = 2
        version = self.int()
        self.int()  # writer's R version
        self.int()  # minimal reader version
        if version == 3:
            n = self.int()
            self.p += n  # native encoding name, e.g. "UTF-8"
        elif version != 2:
            raise ValueError("unsupported R serialisation version %d" % version)

    def item(self):
        flags = self.int()
        t = flags & 0xFF
        levels = flags >> 12
        if t == NILVALUE_SXP:
            return None
        if t == REFSXP:
            idx = flags >> 8
            if idx == 0:
                idx = self.int()
            return self.refs[idx - 1]
        if t == SYMSXP:
            name = self.item()
            self.refs.append(("sym", name))
            return ("sym", name)
        if t == CHARSXP:
            n = self.int()
            if n == -1:
                return None  # NA_character_
            raw = bytes(self.b[self.p:self.p + n])
            self.p += n
            return raw.decode("latin-1" if levels & LATIN1_MASK else "utf-8")
        if t == LISTSXP:
            attr = self.item() if flags & HAS_ATTR else None
            tag = self.item() if flags & HAS_TAG else None
            car = self.item()
            cdr = self.item()
            return ("list", attr, tag, car, cdr)
        if t in (STRSXP, INTSXP, REALSXP):
            n = self.int()
            if t == STRSXP:
                val = [self.item() for _ in range(n)]
            elif t == INTSXP:
                val = list(struct.unpack_from(">%di" % n, self.b, self.p))
                self.p += 4 * n
            else:
                val = list(struct.unpack_from(">%dd" % n, self.b, self.p))
                self.p += 8 * n
            if flags & HAS_ATTR:
                self.item()  # names etc.: not needed
            return val
        raise ValueError("unsupported R SEXP type %d at byte %d" % (t, self.p - 4))


def pairlist_to_dict(pl):
    out = {}
    while pl is not None:
        _, _, tag, car, cdr = pl
        out[tag[1]] = car
        pl = cdr
    return out


def read_index(rdx_path):
    """Rdata.rdx: gzip'd serialisation of list(variables=list(name=c(off, len)), ...)."""
    r = RReader(gzip.decompress(open(rdx_path, "rb").read()))
    r.header()
    # A VECSXP (19) with a names attribute; parse it by hand since RReader skips it.
    flags = r.int()
    if flags & 0xFF != 19:
        raise ValueError("Rdata.rdx: expected a list at the top")
    n = r.int()
    first_flags = r.int()  # variables: a VECSXP of INTSXP pairs
    if first_flags & 0xFF != 19:
        raise ValueError("Rdata.rdx: expected 'variables' to be a list")
    m = r.int()
    pairs = [r.item() for _ in range(m)]
    attrs = pairlist_to_dict(r.item()) if first_flags & HAS_ATTR else {}
    names = attrs.get("names")
    if names is None or len(names) != m:
        raise ValueError("Rdata.rdx: 'variables' has no names")
    del n
    return dict(zip(names, pairs))


def read_block(rdb, off, length):
    """One .rdb entry: 4-byte big-endian uncompressed size, then a zlib stream."""
    blob = rdb[off:off + length]
    (size,) = struct.unpack(">I", blob[:4])
    raw = zlib.decompress(blob[4:])
    if len(raw) != size:
        raise ValueError("block at %d: %d bytes, header says %d" % (off, len(raw), size))
    r = RReader(raw)
    r.header()
    return r.item()


def fetch_deb(tmp):
    subprocess.run(["apt-get", "download", "r-cran-janeaustenr"], cwd=tmp, check=True,
                   stdout=subprocess.DEVNULL)
    debs = glob.glob(os.path.join(tmp, "r-cran-janeaustenr_*.deb"))
    if not debs:
        sys.exit("extract_austen: apt-get download produced no .deb "
                 "(try: apt-get update)")
    return debs[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deb", help="r-cran-janeaustenr .deb (default: apt-get download)")
    ap.add_argument("--out", default=os.path.normpath(os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "data", "austen.txt")))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        deb = os.path.abspath(args.deb) if args.deb else fetch_deb(tmp)
        subprocess.run(["dpkg", "-x", deb, os.path.join(tmp, "x")], check=True)
        found = glob.glob(os.path.join(tmp, "x", "usr", "lib", "R", "site-library",
                                       "janeaustenr", "data", "Rdata.rdb"))
        if not found:
            sys.exit("extract_austen: no janeaustenr/data/Rdata.rdb in %s" % deb)
        rdb_path = found[0]
        index = read_index(rdb_path[:-4] + ".rdx")
        rdb = open(rdb_path, "rb").read()
        novels = []
        for name in NOVELS:
            off, length = index[name]
            lines = read_block(rdb, off, length)
            if not all(isinstance(s, str) for s in lines):
                raise ValueError("%s: expected a character vector of lines" % name)
            # Trim leading/trailing blank lines so the separator is uniform.
            while lines and not lines[0].strip():
                lines.pop(0)
            while lines and not lines[-1].strip():
                lines.pop()
            novels.append("\n".join(lines))
            print("%-17s %6d lines %8d chars" % (name, len(lines), len(novels[-1])))
    text = "\n\n\n".join(novels) + "\n"
    data = text.encode("utf-8")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "wb") as f:
        f.write(data)
    print("wrote %s: %d bytes, sha256 %s" % (args.out, len(data),
                                             hashlib.sha256(data).hexdigest()[:16]))


if __name__ == "__main__":
    main()
