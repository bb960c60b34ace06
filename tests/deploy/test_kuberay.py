"""tests/deploy/kuberay.py: KubeRay's CRDs are used only with their pinned checksums, fetched
into the cache when absent; an unreachable source skips (fails where tools are required)."""

from pathlib import Path

import pytest

from tests import needs
from tests.deploy import kuberay


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv(kuberay.ENV, raising=False)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kuberay, "_unreachable", [])
    return tmp_path


def test_files_with_other_contents_are_refused(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = cache / "crds"
    folder.mkdir()
    for name in kuberay.SHA256:
        (folder / name).write_text("kind: NotACrd\n")
    monkeypatch.setenv(kuberay.ENV, str(folder))
    with pytest.raises(AssertionError, match=r"is not KubeRay's ray\.io_rayclusters\.yaml"):
        kuberay.crd_files()


def test_a_download_with_another_checksum_is_not_kept(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (cache / "ray.io_rayclusters.yaml").write_text("kind: Tampered\n")
    monkeypatch.setattr(kuberay, "URL", f"file://{cache}/{{name}}")
    with pytest.raises(AssertionError, match="not the pinned"):
        kuberay.crd_files()
    assert list(kuberay.cache_dir().iterdir()) == []  # nothing half-written stays


def test_an_unreachable_source_skips_once(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(needs.REQUIRE, raising=False)
    monkeypatch.setattr(kuberay, "URL", f"file://{cache}/absent/{{name}}")
    for _ in range(2):  # the second call does not try again
        with pytest.raises(pytest.skip.Exception, match=f"missing KubeRay's CRDs.*{kuberay.ENV}"):
            kuberay.crd_files()
    assert len(kuberay._unreachable) == 1
    monkeypatch.setenv(needs.REQUIRE, "1")
    with pytest.raises(pytest.fail.Exception):
        kuberay.crd_files()
