"""Code bundles without the API: what check_bundle refuses (and how fast), and the store's zips as Ray
unpacks them.

Packages: service.store.code.
"""

from __future__ import annotations

import hashlib
import random
import tracemalloc
import zipfile
import zlib
from pathlib import Path

import pytest
from ray._private.runtime_env.packaging import unzip_package

from service.errors import ServiceError
from service.store.code.checks import check_bundle, check_digest
from service.store.code.stores import CodeStore

from helpers import EIGHT_MIB, deflated_zeros, one_entry_zip, symlink_zip, zip_of

FILES = {
    "pkg/": b"",
    "pkg/__init__.py": b"",
    "pkg/model.py": b"import torch\n\ndef build(width):\n    return torch.nn.Linear(width, width)\n",
    "data/vocab.txt": bytes(range(256)) * 4,
    "README": b"",
}


def refusal(data: bytes, **limits) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        check_bundle(data, **limits)
    assert (caught.value.status_code, caught.value.error) == (422, "invalid_code")
    assert caught.value.extra["detail"][0]["field"] == "body"
    return caught.value


# --------------------------------------------------------------------------- check_bundle


def test_a_bundle_is_named_by_the_sha256_of_its_bytes_and_counted():
    data = zip_of(FILES)
    info = check_bundle(data)
    assert info.digest == "sha256:" + hashlib.sha256(data).hexdigest()
    assert (info.bytes, info.files) == (len(data), 4)  # the directory is not a file
    assert info.uncompressed_bytes == sum(len(body) for body in FILES.values())


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("a/../x", "entry 'a/../x' has a '..' component"),
        ("../x.py", "entry '../x.py' has a '..' component"),
        ("/etc/cron.d/x", "entry '/etc/cron.d/x' is an absolute path"),
        ("\\Windows\\x", "entry '\\\\Windows\\\\x' is an absolute path"),
        ("C:/x.py", "entry 'C:/x.py' is an absolute path"),
        ("pkg\\x.py", "entry 'pkg\\\\x.py' has a backslash: a zip separates a path's parts with '/'"),
        ("workers/__init__.py", "entry 'workers/__init__.py' would shadow zero1's own package 'workers'"),
        ("./service/x.py", "entry './service/x.py' would shadow zero1's own package 'service'"),
        ("service.py", "entry 'service.py' would shadow zero1's own package 'service'"),
        ("zero1_migrations/", "entry 'zero1_migrations/' would shadow zero1's own package 'zero1_migrations'"),
    ],
)
def test_an_entry_outside_the_bundle_or_over_zero1_is_refused(name, why):
    error = refusal(zip_of({"ok.py": b"", name: b"x"}))
    assert error.message.startswith(f"body: {why}") and error.extra["detail"][0]["entry"] == name


def test_a_module_named_like_a_package_deeper_down_is_fine():
    assert (
        check_bundle(zip_of({"mine/workers.py": b"", "mine/service/__init__.py": b"", "workers_x.py": b""})).files == 3
    )


def test_a_symlink_is_refused():
    assert refusal(symlink_zip("escape", "/etc/passwd")).message == "body: entry 'escape' is a symlink"


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "the body is empty: send a zip"),
        (b'{"model": "not a zip"}', "not a zip file zero1 can read (File is not a zip file)"),
        (zip_of(FILES)[:-30], "not a zip file zero1 can read"),
        (zip_of({"empty/": b""}), "the zip holds no files"),
    ],
    ids=["empty", "json", "truncated", "no files"],
)
def test_what_is_not_a_zip_of_files_is_refused(data, why):
    assert refusal(data).message.startswith(f"body: {why}")


def test_more_entries_than_the_limit_are_refused_before_any_is_read():
    files = {f"m{i}.py": b"" for i in range(6)}
    assert refusal(zip_of(files), max_entries=5).message == "body: the zip has 6 entries, more than the limit of 5"
    assert check_bundle(zip_of(files), max_entries=6).files == 6


def test_a_zip_bomb_is_stopped_at_the_limit_while_it_is_read():
    """1 MiB that would unpack to 1 GiB: refused after 10 MiB, holding a few MiB at most."""
    bomb = deflated_zeros(num_blocks=128)
    assert len(bomb) < 1.1 * (1 << 20)
    for claimed_bytes in (128 * EIGHT_MIB, 100):  # the header says the truth, or lies
        data = one_entry_zip("bomb.bin", bomb, claimed_bytes=claimed_bytes)
        tracemalloc.start()
        try:
            error = refusal(data, max_uncompressed_bytes=10 << 20)
            _, peak_bytes = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert error.message == "body: the bundle unpacks to more than 10485760 bytes (10 MiB) at entry 'bomb.bin'"
        assert peak_bytes < 8 << 20


def test_an_entry_larger_than_its_header_says_is_refused():
    data = one_entry_zip("x.bin", deflated_zeros(num_blocks=1), claimed_bytes=100, crc=zlib.crc32(bytes(EIGHT_MIB)))
    assert refusal(data).message == "body: entry 'x.bin' unpacks to 8388608 bytes, but its header says 100"


def test_the_limit_counts_every_file():
    files = {"a.bin": bytes(600 << 10), "b.bin": bytes(600 << 10)}
    error = refusal(zip_of(files), max_uncompressed_bytes=1 << 20)
    assert error.message == "body: the bundle unpacks to more than 1048576 bytes (1 MiB) at entry 'b.bin'"


def test_damaged_encrypted_and_unusual_entries_are_refused():
    data = bytearray(zip_of({"a.txt": b"hello " * 100}, compression=zipfile.ZIP_STORED))
    data[40] ^= 0xFF  # a byte of the stored data: its CRC no longer matches
    assert refusal(bytes(data)).message.startswith("body: entry 'a.txt' is damaged (Bad CRC-32")
    bzip2 = refusal(zip_of({"a.txt": b"hello"}, compression=zipfile.ZIP_BZIP2))
    assert bzip2.message == "body: entry 'a.txt' is compressed by method 12; zip it with deflate (8) or none (0)"
    twice = refusal(zip_of({"a.py": b"", "./a.py": b""}))
    assert twice.message == "body: entry './a.py' names the same path as an earlier entry"


def test_random_damage_is_always_a_422_never_a_crash():
    good = zip_of(FILES)
    rng = random.Random(16)
    for _ in range(500):
        data = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            check_bundle(bytes(data[: rng.randrange(len(data) // 2, len(data) + 1)]))
        except ServiceError as error:
            assert error.status_code == 422, error.message


# --------------------------------------------------------------------------- the store


def stored_files(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def test_the_store_keeps_one_zip_per_digest_under_bundle(tmp_path):
    store = CodeStore(tmp_path / "code")
    data = zip_of({"run.sh": b"#!/bin/sh\n", **FILES})
    info, created = store.put(data)
    assert created and info == check_bundle(data)
    hex_digest = info.digest.removeprefix("sha256:")
    assert stored_files(store.root) == [f"{hex_digest}.zip"]
    assert store.exists(info.digest) and store.uri(info.digest) == f"file://{store.root}/{hex_digest}.zip"
    again, created = store.put(data)
    assert (again, created) == (info, False) and stored_files(store.root) == [f"{hex_digest}.zip"]

    with zipfile.ZipFile(store.path(info.digest)) as stored:
        names = stored.namelist()
        assert names == ["bundle/", *sorted(f"bundle/{name}" for name in ["run.sh", *FILES])]
        assert all(stored.read(f"bundle/{name}") == body for name, body in FILES.items() if not name.endswith("/"))


def test_ray_unpacks_a_stored_zip_to_exactly_the_users_files(tmp_path):
    store = CodeStore(tmp_path / "code")
    info, _ = store.put(zip_of(FILES))
    target = tmp_path / "working_dir"
    unzip_package(str(store.path(info.digest)), str(target), remove_top_level_directory=True, unlink_zip=False)
    unpacked = {str(path.relative_to(target)): path.read_bytes() for path in target.rglob("*") if path.is_file()}
    assert unpacked == {name: body for name, body in FILES.items() if not name.endswith("/")}
    assert (target / "pkg").is_dir() and sorted(path.name for path in target.iterdir()) == ["README", "data", "pkg"]


def test_a_refused_bundle_leaves_nothing_in_the_store(tmp_path):
    store = CodeStore(tmp_path / "code", max_uncompressed_bytes=1 << 20)
    store.put(zip_of({"ok.py": b""}))
    before = stored_files(store.root)
    for data in (zip_of({"a/../x": b""}), zip_of({"big.bin": bytes(2 << 20)}), b"not a zip"):
        with pytest.raises(ServiceError):
            store.put(data)
    assert stored_files(store.root) == before  # no temporary file left either


def test_digests_are_checked_and_unwritable_storage_is_a_503(tmp_path):
    for digest in ("sha256:" + "A" * 64, "sha256:abc", "md5:" + "a" * 64, "sha256:" + "a" * 64 + "/../x"):
        with pytest.raises(ServiceError) as caught:
            check_digest(digest, field="digest")
        assert caught.value.status_code == 422 and caught.value.message.startswith(f"digest: {digest[:80]!r} is not")
    (tmp_path / "file").write_text("")
    with pytest.raises(ServiceError) as caught:
        CodeStore(tmp_path / "file" / "code").put(zip_of({"ok.py": b""}))
    assert (caught.value.status_code, caught.value.error) == (503, "code_storage_unwritable")
