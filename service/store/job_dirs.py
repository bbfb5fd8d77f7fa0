"""A job's directory on the checkpoint storage: made by the service for the job's uid, and what a
finished job keeps of it (in a directory, or under its prefix on an object store, where no
directory is made: workers/runtime/spool.py).

    <checkpoint_uri>/                 0711 where jobs run as other uids: reached, never listed
        job-<id>-<run_id>/            0700, owned by the job's uid (ZERO1_RUN_AS): its children's HOME
            step-*/  final/           checkpoints and the final model (workers/training/checkpoints.py)
            tmp/  working_dir_files/  the children's TMPDIR and their copy of the code bundle
"""

from __future__ import annotations

import os
from pathlib import Path

from workers.records import RunAs
from workers.training import confined
from workers.training.checkpoints import FINAL, discard_stored_metrics, prune_checkpoints
from workers.training.storage import DirectoryStore, Store

_ALL_STEPS = 2**62


def prepare_job_dir(directory: Path, *, run_as: RunAs | None, database_url: str) -> None:
    """Make `directory` (mode 0700, whatever the umask), owned by `run_as` where jobs run as other
    uids; the private directories above it it must traverse become 0711 then."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    directory.mkdir(mode=0o700, exist_ok=True)
    if run_as is not None:
        for above in _state_dirs_above(directory, database_url):
            os.chmod(above, 0o711)
        os.chown(directory, run_as.uid, run_as.gid, follow_symlinks=False)
    os.chmod(directory, 0o700, follow_symlinks=False)


def _state_dirs_above(job_dir: Path, database_url: str) -> list[Path]:
    """The directories a job's uid must traverse that the service keeps private: the storage root,
    and the SQLite database's directory when the storage lies inside it (the default .zero1/)."""
    dirs = [job_dir.parent]
    if database_url.startswith("sqlite:///"):
        state = Path(database_url.removeprefix("sqlite:///")).resolve().parent
        if state in job_dir.parents and state != job_dir.parent:
            dirs.append(state)
    return dirs


def retire_job_dir(store: Store, *, keep: int) -> None:
    """What a finished job (its rows stored) keeps: its newest `keep` complete checkpoints and its
    final model (final/); with 0, final/ alone. In a directory, its children's scratch goes too."""
    local = isinstance(store, DirectoryStore)
    if keep == 0:
        if local:
            remove_except(store.root, keep_name=FINAL)
        else:
            for name in store.list():
                if name != FINAL:
                    store.remove_tree(name)
        return
    if local and not store.root.exists():
        return
    prune_checkpoints(store, keep_last=keep, keep_newest_unfinished=False)
    discard_stored_metrics(store, through_step=_ALL_STEPS)
    if local:
        remove_scratch(store.root)


def remove_scratch(directory: Path) -> None:
    """Delete what a finished job's children left beside its checkpoints and final model (their
    TMPDIR, their code copy, anything written to HOME); links are removed, never followed, and
    nothing is reached through one (workers/training/confined.py)."""
    for name in _entries(directory):
        if name != FINAL and not name.startswith("step-"):
            confined.remove_tree(directory, name)


def remove_except(directory: Path, *, keep_name: str) -> None:
    """Delete everything in directory but its entry keep_name; the directory too when that is absent."""
    if not directory.exists():
        return
    for name in _entries(directory):
        if name != keep_name:
            confined.remove_tree(directory, name)
    if not _entries(directory):
        directory.rmdir()


def _entries(directory: Path) -> list[str]:
    """Every name in the directory, links included (list_dir leaves them out: they are deleted too)."""
    with confined.opened_dir(directory) as fd:
        return sorted(os.listdir(fd))
