"""KubeRay's CRDs, which the manifest tests validate RayCluster objects against.

They are the ray.io_*.yaml files of ray-project/kuberay's ray-operator/config/crd/bases/ at
COMMIT (after v1.7.0), not vendored here: the first run downloads them into the user's cache
(`~/.cache/specdec/kuberay-crds/<commit>/`; SPECDEC_CACHE_DIR or XDG_CACHE_HOME move it) and
checks each file's SHA-256. SPECDEC_KUBERAY_CRDS names a folder that already holds them (a
machine without access to GitHub); its files are checked against the same checksums.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from tests import needs

COMMIT = "feeaf72facab4881ba2b179248bb67315634e229"
SHA256 = {
    "ray.io_rayclusters.yaml": "c44704442eef0c6721ad40c1d66782c8bd3fdab9d3344306a5820910a679baa1",
    "ray.io_rayjobs.yaml": "01a5cf3b17c1769fda44af7e82debcd98722f0c27b9ab84d084681c6649121f5",
    "ray.io_rayservices.yaml": "0a8fc325e6e22b9231c1f282b309555e2ecf94227ca20a03df3d1d9a403907ab",
}
URL = (
    "https://raw.githubusercontent.com/ray-project/kuberay/{commit}"
    "/ray-operator/config/crd/bases/{name}"
)
ENV = "SPECDEC_KUBERAY_CRDS"
HOW = (
    f"the tests download them from GitHub (ray-project/kuberay at {COMMIT[:7]}, "
    f"ray-operator/config/crd/bases/ray.io_*.yaml); without network access put those files in "
    f"a folder and set {ENV} to it"
)


def cache_dir() -> Path:
    if env := os.environ.get("SPECDEC_CACHE_DIR"):
        base = Path(env)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec"
    return base / "kuberay-crds" / COMMIT


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check(folder: Path) -> list[Path]:
    """The CRD files in `folder`, each with its pinned checksum; AssertionError otherwise."""
    paths = [folder / name for name in sorted(SHA256)]
    for path in paths:
        assert path.is_file(), f"{path} is missing ({ENV}={folder}?)"
        got = sha256(path)
        assert got == SHA256[path.name], (
            f"{path} is not KubeRay's {path.name} at {COMMIT[:7]}: SHA-256 {got}"
        )
    return paths


_unreachable: list[str] = []  # why the download failed, once: later tests do not wait again


def download(name: str, folder: Path) -> None:
    """Fetch one CRD file into `folder`, atomically and only if its checksum matches."""
    url = URL.format(commit=COMMIT, name=name)
    if not _unreachable:
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                data = response.read()
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            _unreachable.append(f"{name} could not be downloaded: {e}")
    if _unreachable:
        needs.missing(f"KubeRay's CRDs ({_unreachable[0]})", HOW)
    got = hashlib.sha256(data).hexdigest()
    assert got == SHA256[name], f"{url} has SHA-256 {got}, not the pinned {SHA256[name]}"
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=folder)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, folder / name)


def crd_files() -> list[Path]:
    """The checked CRD files: from SPECDEC_KUBERAY_CRDS, else the cache, downloaded if absent."""
    if env := os.environ.get(ENV):
        return check(Path(env))
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    for name, digest in SHA256.items():
        path = folder / name
        if not (path.is_file() and sha256(path) == digest):
            download(name, folder)
    return check(folder)
