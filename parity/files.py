"""The user's files in, parity's directories out: the one way each goes.

Every text file parity reads (datasets, reward modules, YAML configs, audit inputs, prompt
files, metrics) goes through `read_text`, so a file that is not text, or not UTF-8, is one line
naming the file and the byte offset rather than a traceback from deep inside a parser. Every
output directory goes through `ensure_writable` before any work, so a path that cannot become a
directory is refused before anything is created (docs/errors.md, "Files", "Output paths").
"""

from __future__ import annotations

# Imports inside functions: each reader's library (pyarrow, safetensors, torch) loads when a file
# of its kind is read: the command line reads YAML and JSON without them (start-up time).
import contextlib
import errno
import importlib
import io
import json
import logging
import os
import pickle
import shutil
import sys
import tempfile
import tokenize
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

from parity.errors import ParityError, one_line

BOM = b"\xef\xbb\xbf"  # editors on Windows start UTF-8 files with it; it is not content


def _unreadable(e: OSError, p: Path, what: str) -> ParityError:
    if isinstance(e, FileNotFoundError):
        return ParityError(f"{what} {p} does not exist")
    if isinstance(e, IsADirectoryError):
        return ParityError(f"{what} {p} is a directory, not a file")
    return ParityError(f"cannot read {what} {p}: {e.strerror or one_line(e)}")


def read_bytes(path: str | Path, what: str) -> bytes:
    p = Path(path)
    try:
        return p.read_bytes()
    except OSError as e:
        raise _unreadable(e, p, what) from None


def read_text(path: str | Path, what: str, encoding: str = "utf-8") -> str:
    """The file's text; `what` names it in the message ("dataset", "config file", ...). Bytes
    that do not decode, or a NUL (a binary file), are refused with their offset and line."""
    p = Path(path)
    data = read_bytes(p, what)
    skip = 0
    if encoding.lower().replace("_", "-") in ("utf-8", "utf8", "utf-8-sig"):
        encoding, skip = "utf-8", len(BOM) if data.startswith(BOM) else 0
    try:
        text = data[skip:].decode(encoding)
    except UnicodeDecodeError as e:
        at = skip + e.start
        line = data.count(b"\n", 0, at) + 1
        name = "UTF-8" if encoding == "utf-8" else encoding
        raise ParityError(f"{what} {p} is not {name} text: byte 0x{data[at]:02x} at offset {at} "
                          f"(line {line}) does not decode; save it as UTF-8") from None
    except LookupError:
        raise ParityError(f"{what} {p} declares the unknown encoding {encoding!r}") from None
    nul = text.find("\x00")
    if nul >= 0:
        at = skip + len(text[:nul].encode(encoding))
        line = text.count("\n", 0, nul) + 1
        raise ParityError(f"{what} {p} is binary, not text: a NUL byte at offset {at} (line "
                          f"{line})")
    return text


def lines(text: str) -> list[str]:
    """Lines split at newlines only: str.splitlines also splits at U+2028 and form feeds, which
    JSON strings may hold, and would shift every line number after them."""
    return [x[:-1] if x.endswith("\r") else x for x in text.split("\n")]


def json_lines(path: str | Path, what: str, text: str | None = None
               ) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of a JSON Lines file (`text`: its content,
    when the caller has read it already); a line that is not JSON is refused with its number."""
    p = Path(path)
    for n, line in enumerate(lines(read_text(p, what) if text is None else text), start=1):
        if line.strip():
            yield n, parse_json(line, f"{what} {p} line {n}")


def parse_json(text: str, where: str) -> Any:
    """One JSON document; an error names `where`, and the line of a document of several."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        at = f"column {e.colno}" if e.lineno == 1 and "\n" not in text else (
            f"line {e.lineno}, column {e.colno}")
        raise ParityError(f"{where}: not valid JSON ({e.msg} at {at})") from None
    except RecursionError:
        raise ParityError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise ParityError(f"{where}: not valid JSON ({one_line(e)})") from None


def read_json(path: str | Path, what: str) -> Any:
    return parse_json(read_text(path, what), f"{what} {Path(path)}")


def read_python(path: str | Path, what: str) -> str:
    """A Python source's text in the encoding it declares (PEP 263; UTF-8 by default), so a
    module with a latin-1 coding line is read as Python reads it."""
    data = read_bytes(path, what)
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as e:
        read_text(path, what)  # no declaration and not UTF-8: named with its offset here
        raise ParityError(f"{what} {path}: {e.msg}") from None
    return read_text(path, what, encoding)


def read_parquet(path: str | Path, what: str) -> Any:
    """A parquet file as a pyarrow Table; a file that is not parquet is one line."""
    import pyarrow.parquet as pq
    try:  # a missing or unreadable file is named as every other reader names it
        open(path, "rb").close()
    except OSError as e:
        raise _unreadable(e, Path(path), what) from None
    try:
        return pq.read_table(path)
    except Exception as e:  # pyarrow's errors share no base class a caller could name
        raise ParityError(f"{what} {path} is not a readable parquet file: {one_line(e)}") from None


# Bytes per element of each dtype the safetensors format names.
_SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
                      "BF16": 2, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                      "F8_E4M3": 1, "F8_E5M2": 1}


def check_safetensors(path: str | Path, what: str) -> None:
    """Refuse a .safetensors file that is cut short, or whose header does not describe its
    bytes, naming the file and the first problem: a library reading it would end in its own
    traceback (SafetensorError, or a RuntimeError from deep inside a load)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            header = f.read(n) if 0 <= n <= size - 8 else b""
    except OSError as e:
        raise _unreadable(e, p, what) from None
    bad = lambda why: ParityError(f"{what} {p} is not a whole safetensors file: {why}")
    if n < 0:
        raise bad(f"{size} bytes, shorter than the 8-byte header length")
    if n > size - 8:
        raise bad(f"its header claims {n} bytes and the file holds {size} (cut short?)")
    try:
        entries = json.loads(header.decode("utf-8"))
        if not isinstance(entries, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"its header is not JSON ({one_line(e)})") from None
    end = 0
    for name, t in entries.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = t["data_offsets"]
            count = 1
            for d in t["shape"]:
                count *= int(d)
            width = _SAFETENSORS_BYTES[t["dtype"]]
            ok = 0 <= start <= stop and stop - start == count * width
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise bad(f"tensor {name!r}: its header entry does not describe its bytes ({t!r:.120})")
        end = max(end, stop)
    if 8 + n + end != size:
        raise bad(f"its tensors need {8 + n + end} bytes and the file holds {size}"
                  + (" (cut short?)" if size < 8 + n + end else ""))


def read_safetensors(path: str | Path, what: str) -> dict[str, Any]:
    """The tensors of a .safetensors file, checked first (`check_safetensors`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    check_safetensors(path, what)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ParityError(f"{what} {path} cannot be read: {one_line(e)}") from None


def read_torch(path: str | Path, what: str) -> Any:
    """A torch.save file, with `weights_only=True` (no code runs); one that is cut or damaged
    is one line naming it."""

    import torch
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except OSError as e:
        raise _unreadable(e, Path(path), what) from None
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, KeyError) as e:
        raise ParityError(f"{what} {path} cannot be read (damaged or cut short?): "
                          f"{one_line(e)}") from None


def check_gguf(path: str | Path, what: str) -> None:
    """Refuse a file that is not GGUF by its magic bytes and version, or is cut before its
    tensor and metadata counts, before a library parses it."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            head = f.read(24)
    except OSError as e:
        raise _unreadable(e, p, what) from None
    if len(head) < 24 or head[:4] != b"GGUF":
        raise ParityError(f"cannot read {what} {p}: not a GGUF file ("
                          + (f"it starts {head[:4]!r}" if len(head) >= 4 else
                             f"{len(head)} bytes") + ")")
    version = int.from_bytes(head[4:8], "little")
    if version not in (1, 2, 3):
        raise ParityError(f"cannot read {what} {p}: it declares GGUF version {version}, and "
                          f"versions 1-3 exist (damaged?)")


def arrow_rows(table: Any, what: str) -> list[dict[str, Any]]:
    """A pyarrow Table's rows as dicts. Parquet stores strings as bytes and checks no encoding,
    so a string that is not UTF-8 is found and named by row and column."""
    try:
        return table.to_pylist()
    except UnicodeDecodeError as first:
        for c in table.column_names:
            col = table.column(c)
            for i in range(len(col)):
                try:
                    col[i].as_py()
                except UnicodeDecodeError as e:
                    raise ParityError(f"{what} row {i}, column {c!r}: not UTF-8 text (byte "
                                      f"0x{e.object[e.start]:02x} at offset {e.start} of the "
                                      f"value does not decode)") from None
        raise ParityError(f"{what}: a value is not UTF-8 text ({first.reason})") from None


def size_text(n: float) -> str:
    for unit, scale in (("GB", 2 ** 30), ("MB", 2 ** 20), ("KB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def free_bytes(path: str | Path) -> int | None:
    """The bytes free on the file system that holds `path` (or the nearest directory above it
    that exists); None where the system does not say."""
    for q in (Path(path), *Path(path).absolute().parents):
        try:
            return shutil.disk_usage(q).free
        except OSError:
            continue
    return None


def is_disk_full(e: BaseException) -> bool:
    """Whether a failed write ran out of space: an OSError says so by its errno; torch and
    safetensors wrap it in a RuntimeError whose text carries the system's words or code."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(e)
    return any(w in text for w in ("No space left", "StorageFull", "code: 28",
                                   "Disk quota exceeded"))


def write_failure(e: BaseException, path: str | Path, needed: int, what: str,
                  after: str = "", full: bool = False) -> ParityError:
    """One line for a write that failed: a full disk (`full`: the caller found it so) names the
    path and the space it needs beside the space free; anything else names the path and the
    system's reason."""
    if full or is_disk_full(e):
        free = free_bytes(path)
        has = f", {size_text(free)} is free there" if free is not None else ""
        return ParityError(f"no space left on the device to write {what} {path}: it needs about "
                           f"{size_text(needed)}{has}{after}")
    reason = e.strerror if isinstance(e, OSError) and e.strerror else one_line(e)
    return ParityError(f"cannot write {what} {path}: {reason}{after}")


def write_atomic(path: str | Path, data: bytes, what: str) -> None:
    """`data` in `path`, in one rename: a reader, or a crash, sees the old file or the new one.
    A write that fails (a full disk) leaves the old file as it was, and is one line."""
    p = Path(path)
    tmp = p.with_name(f".tmp-{p.name}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise write_failure(e, p, len(data), what) from None


class LineLog:
    """A JSON Lines file a run appends to, one whole line per write: a line the system cannot
    take (a full disk) is taken back, so the file holds only whole lines, and the failure is one
    line naming the file and the space the line needs. `after` ends that message (what the
    user can do)."""

    def __init__(self, path: str | Path, what: str, after: str = "") -> None:
        self.path, self.what, self.after = Path(path), what, after
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise write_failure(e, self.path, 0, what) from None

    def write(self, line: str) -> None:
        data = line.encode("utf-8")
        start = os.fstat(self.fd).st_size
        try:
            done = 0
            while done < len(data):
                done += os.write(self.fd, data[done:])
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, start)  # never leave half a record behind
            raise write_failure(e, self.path, len(data), self.what, self.after) from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "LineLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ensure_writable(path: str | Path, what: str) -> None:
    """Refuse an output directory that could not be created or written: an existing file, a
    path under a file, or a directory without write permission. Looks up to the first path
    that exists, so nothing is created here. (Root passes every permission check but a
    read-only file system's.)"""
    p = Path(path)
    try:
        probe = next((q for q in (p, *p.parents, p.absolute(), *p.absolute().parents)
                      if _exists(q)), None)
        if probe is None:
            raise ParityError(f"{what} {p} cannot be created: no directory above it exists")
        if probe.is_symlink() and not probe.exists():
            raise ParityError(f"{what} {p} cannot be created: {probe} is a broken symbolic "
                              f"link")
        if not probe.is_dir():
            if probe == p:
                raise ParityError(f"{what} {p} is a file, not a directory")
            raise ParityError(f"{what} {p} cannot be created: {probe} is a file, not a "
                              f"directory")
    except OSError as e:  # e.g. a path too long, or a directory above it we may not enter
        raise ParityError(f"{what} {p}: {e.strerror or one_line(e)}") from None
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ParityError(f"{what} {p} cannot be written: {probe} is not writable")
    if (fs := kernel_file_system(probe)) is not None:
        raise ParityError(f"{what} {p} cannot be created: {probe} is on {fs}, a file system the "
                          f"kernel makes up, where no files can be written")


# File systems the kernel makes up (its state as files): a directory on them cannot hold a run,
# yet they pass the permission check (root "may write" /proc, and mkdir then fails oddly).
_KERNEL_FS = {"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
              "securityfs", "pstore", "bpf", "configfs", "mqueue", "fusectl", "binfmt_misc",
              "efivarfs", "autofs", "hugetlbfs", "nsfs", "rpc_pipefs", "selinuxfs"}


def kernel_file_system(path: Path) -> str | None:
    """The kernel file system (`proc`, `sysfs`, ...) that holds `path`, from /proc/self/mounts
    (the longest mount point above it); None for an ordinary one, or where mounts are unknown."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return None
    where = os.path.realpath(path)
    best = max((m for m in mounts if where == m[0] or where.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return best[1] if best is not None and best[1] in _KERNEL_FS else None


def _exists(p: Path) -> bool:
    """Whether anything (a broken link too) is at `p`. Unlike os.path.lexists, an error other
    than "no such file" (a name too long, a directory we may not enter) is raised, not taken
    for absence."""
    try:
        os.lstat(p)
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False


def exists(path: str | Path, what: str) -> bool:
    """Whether the user's `path` exists; a path the system cannot even look up (a name too
    long, a directory we may not enter) is one line instead of Path.exists's OSError."""
    try:
        return _exists(Path(path)) and Path(path).exists()
    except OSError as e:
        raise ParityError(f"{what} {path}: {e.strerror or one_line(e)}") from None


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """transformers and datasets log a failure in lines of their own, and warn, before they
    raise; parity reports the exception in one line, so their loggers and warnings are silenced
    while they load the user's files. Their progress bars are turned off for good: parity draws
    its own, and a bar of theirs (a checkpoint's save_pretrained) would interleave with it."""
    for name in ("transformers", "datasets"):
        if name in sys.modules:  # a library not loaded yet draws no bar
            importlib.import_module(f"{name}.utils.logging").disable_progress_bar()
    loggers = [logging.getLogger(name) for name in ("transformers", "datasets")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def one_builder(final: Path, progress: bool = False) -> Iterator[None]:
    """Held while this process builds `final`: a second process that wants the same directory
    (two runs started together, the test workers) waits here and then finds it built, instead of
    spending the same minutes again. An advisory lock on a file beside it, which the holder
    removes, so the cache keeps no trace; the kernel releases it if the holder dies. Where the
    platform has no fcntl, every process builds its own and publish_dir keeps the first."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    lock = final.parent / f".{final.name}.lock"
    said = False
    while True:
        f = open(lock, "a")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress and not said:
                from parity.ui import say
                say(f"waiting for another process that is building {final.name}: {final}")
                said = True
            fcntl.flock(f, fcntl.LOCK_EX)
        try:  # the holder before us removed the file: our lock is on a file nobody else sees
            if os.fstat(f.fileno()).st_ino == os.stat(lock).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)   # before the unlock, so a waiter sees the stale file
        f.close()


def publish_dir(make: Callable[[], object], tmp: Path, final: Path,
                is_done: Callable[[Path], bool]) -> None:
    """Run `make` (which fills the fresh directory `tmp` beside `final`), then put `tmp` in
    `final`'s place in one rename, so a reader sees the old directory or the finished new one,
    never half of it. A failure removes `tmp`; another process that finished first wins."""
    try:
        make()
        # mkdtemp makes the directory private, and some writers their files: a model cache is
        # meant to be shared.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            if f.is_file():
                os.chmod(f, 0o644)
        if final.exists():  # rename cannot replace a non-empty directory: move the old one aside
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, old / final.name)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not is_done(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cache_dir() -> Path:
    """$PARITY_CACHE, else $XDG_CACHE_HOME/parity, else ~/.cache/parity."""
    if os.environ.get("PARITY_CACHE"):
        return Path(os.environ["PARITY_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "parity"
