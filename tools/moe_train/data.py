"""Training data: a corpus as byte tokens, a held-out split by file, deterministic batches.

Batches and seeds are functions of integers such as ``(seed, step, micro, rank)`` only, so
two recipes see the same data in the same order and a resumed run continues the same curve.
"""

import sysconfig
import zlib
from pathlib import Path

import torch

from .checks import RunError

VOCAB = 256  # byte-level tokens
HELDOUT_EVERY = 20  # one file in 20 (by CRC32 of its relative path) is held out


def _is_binary(f):
    """A file with a NUL byte in its first 4 KiB (text files have none)."""
    with open(f, "rb") as fh:
        return b"\0" in fh.read(4096)


def _corpus_files(path, stdlib):
    """Sorted ``(relative name, path)`` of the text files under ``path`` (or ``path`` itself).

    Skips caches, VCS folders and installed packages; the stdlib default takes only its
    ``.py`` sources. Binary files (``_is_binary``) are refused as ``path`` itself and left
    out of a folder, which must keep at least one text file.
    """
    root = Path(path)
    if root.is_file():
        if _is_binary(root):
            raise RunError(f"--data {path}: a binary file (a NUL byte in its first 4 KiB); "
                           f"pass a text file or a folder of text files")
        return [(root.name, root)]
    if not root.is_dir():
        raise RunError(f"--data {path}: no such file or folder")
    skip = {"__pycache__", ".git", ".hg", ".svn", "site-packages", "node_modules"}
    found, binary = [], []
    for f in root.rglob("*.py" if stdlib else "*"):
        if f.is_file() and not skip.intersection(f.relative_to(root).parts):
            (binary if _is_binary(f) else found).append((str(f.relative_to(root)), f))
    if binary and not found:
        raise RunError(f"--data {path}: holds only binary files ({len(binary)}, e.g. "
                       f"{sorted(binary)[0][0]}: a NUL byte in their first 4 KiB); pass a "
                       f"file or folder of text")
    return sorted(found)


def load_corpus(path=None):
    """Byte tokens of a corpus, split into train and held-out parts by file.

    Arguments:
        path: a text file or a folder; ``None`` for the stdlib's ``.py`` sources.

    Returns:
        ``(train, heldout, description)``: uint8 tensors of the concatenated files (each
        file followed by a NUL byte). A single file is split 95/5 by position instead.
    """
    stdlib = path is None
    path = path or sysconfig.get_paths()["stdlib"]
    files = _corpus_files(path, stdlib)
    if not files:
        raise RunError(f"--data {path}: holds no files (caches, VCS folders and installed "
                       f"packages are skipped); pass a text file or a folder of text files")
    train, held = bytearray(), bytearray()
    for name, f in files:
        blob = f.read_bytes() + b"\0"
        (held if zlib.crc32(name.encode()) % HELDOUT_EVERY == 0 else train).extend(blob)
    if len(files) == 1:
        cut = len(train) * (HELDOUT_EVERY - 1) // HELDOUT_EVERY
        train, held = train[:cut], train[cut:]
    if not held:  # a small folder whose every file hashed to train
        cut = len(train) * (HELDOUT_EVERY - 1) // HELDOUT_EVERY
        train, held = train[:cut], train[cut:]
    desc = f"{path} ({len(files)} files, {len(train) / 1e6:.1f} MB train, {len(held) / 1e6:.2f} MB held out)"
    as_tensor = lambda b: torch.frombuffer(b, dtype=torch.uint8).clone()  # noqa: E731
    return as_tensor(train), as_tensor(held), desc


def check_lengths(train, heldout, seq_len, path):
    """Both splits must hold a window of ``seq_len + 1`` bytes (checked before the first
    step, not at the first evaluation)."""
    for name, data in (("training", train), ("held-out", heldout)):
        if len(data) <= seq_len + 1:
            raise RunError(f"--data {path or 'default'}: the {name} text is {len(data)} bytes, "
                           f"not longer than --seq-len {seq_len} + 1; pass more text or a "
                           f"smaller --seq-len")


def mix_seed(*ints):
    """A 63-bit seed from a few integers, the same in every process and Python version."""
    return zlib.crc32(repr(ints).encode()) * 0x9E3779B1 % (1 << 63)


def train_batch(data, seq_len, batch, seed, step, micro, rank):
    """Random windows of ``data`` chosen by ``(seed, step, micro, rank)`` only.

    Arguments:
        data: uint8 ``[N]`` training tokens.

    Returns:
        ``(inputs, targets)``: int64 ``[batch, seq_len]``, targets shifted by one byte.
    """
    if len(data) <= seq_len + 1:
        raise ValueError(f"the training text ({len(data)} bytes) is shorter than --seq-len {seq_len}")
    g = torch.Generator().manual_seed(mix_seed(seed, step, micro, rank))
    starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g)
    rows = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def eval_batches(data, seq_len, batch, n_batches, rank, world):
    """This rank's share of a fixed set of evenly spaced held-out windows.

    Arguments:
        data: uint8 ``[N]`` held-out tokens.

    Returns:
        A generator of ``n_batches`` ``(inputs, targets)``, int64 ``[batch, seq_len]``.
    """
    total = n_batches * batch * world
    if len(data) <= seq_len + 1:
        raise ValueError(f"the held-out text ({len(data)} bytes) is shorter than --seq-len {seq_len}")
    starts = torch.linspace(0, len(data) - seq_len - 1, total).long()[rank::world]
    for i in range(n_batches):
        rows = torch.stack([data[s:s + seq_len + 1] for s in starts[i * batch:(i + 1) * batch].tolist()])
        yield rows[:, :-1].long(), rows[:, 1:].long()
