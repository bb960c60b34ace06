"""Grafana's own dashboard schema, as JSON Schema, and a check of specdec.json against it.

    python deploy/grafana/schema.py deploy/grafana/specdec.json

@grafana/schema (npm; the version of Grafana whose types grafana-foundation-sdk builds, 11.6)
ships no JSON Schema and no CUE, only the TypeScript types generated from Grafana's CUE kinds.
ts-json-schema-generator turns those types into JSON Schemas (draft 7; objects without an index
signature get `additionalProperties: false`, so an unknown field fails), and jsonschema checks:

- the whole dashboard against `Dashboard` of raw/dashboard/x/dashboard_types.gen.d.ts (the
  type generated from the CUE kind) and against `Dashboard` of index.d.ts (the package's own
  refinement of it, which Grafana's frontend uses);
- each time series panel's `options` and `fieldConfig.defaults.custom` against `Options` and
  `FieldConfig` of the timeseries panel's types (the dashboard type leaves both open).

The packages are installed with npm under ~/.cache/specdec/npm (SPECDEC_NPM_CACHE moves it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

GRAFANA_SCHEMA = "@grafana/schema@11.6.16"
GENERATOR = "ts-json-schema-generator@2.9.0"
TIMESERIES = "raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen.d.ts"
# name -> (file under @grafana/schema/dist/esm, type, extra generator flags)
TYPES = {
    "dashboard": ("raw/dashboard/x/dashboard_types.gen.d.ts", "Dashboard", ()),
    # --expose none inlines every type: the refinement re-exports names (DataSourceRef) that
    # the generator would otherwise refuse as defined twice
    "dashboard_index": ("index.d.ts", "Dashboard", ("--expose", "none")),
    "timeseries_options": (TIMESERIES, "Options", ()),
    "timeseries_field_config": (TIMESERIES, "FieldConfig", ()),
}


def npm_cache() -> Path:
    if env := os.environ.get("SPECDEC_NPM_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specdec" / "npm"


def npm_install(*packages: str) -> Path:
    """A folder whose node_modules holds `packages` (name@version each), installed once."""
    key = hashlib.sha256(" ".join(sorted(packages)).encode()).hexdigest()[:12]
    final = npm_cache() / key
    if (final / "installed.json").is_file():
        return final
    npm = shutil.which("npm")
    if npm is None:
        raise FileNotFoundError(f"npm is needed to install {', '.join(packages)}.")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=final.parent))
    try:
        subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--no-save", "--prefix", str(tmp),
             *packages],
            check=True, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        (tmp / "installed.json").write_text(json.dumps(sorted(packages)))
        try:
            tmp.rename(final)
        except OSError:  # installed by another process meanwhile
            if not (final / "installed.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schemas of TYPES, generated once into the npm folder."""
    folder = npm_install(GRAFANA_SCHEMA, GENERATOR)
    types = folder / "node_modules" / "@grafana" / "schema" / "dist" / "esm"
    generator = folder / "node_modules" / ".bin" / "ts-json-schema-generator"
    out = {}
    for name, (path, type_name, flags) in TYPES.items():
        target = folder / "schemas" / f"{name}.json"
        if not target.is_file():
            target.parent.mkdir(exist_ok=True)
            subprocess.run(
                [str(generator), "--path", str(types / path), "--type", type_name, *flags,
                 "--out", str(target)],
                check=True, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
        out[name] = json.loads(target.read_text())
    return out


def problems(dashboard: dict[str, Any], checked: dict[str, dict[str, Any]]) -> list[str]:
    """Every way `dashboard` breaks the schemas `checked` (from `schemas()`); [] when none."""
    import jsonschema

    def errors(name: str, instance: Any, where: str) -> list[str]:
        validator = jsonschema.Draft7Validator(checked[name])
        return [
            f"{where}/{'/'.join(map(str, e.absolute_path))}: {e.message} ({name})"
            for e in validator.iter_errors(instance)
        ]

    found = errors("dashboard", dashboard, "")
    found += errors("dashboard_index", dashboard, "")
    for i, panel in enumerate(dashboard.get("panels", ())):
        if panel.get("type") == "timeseries":
            where = f"/panels/{i}"
            found += errors("timeseries_options", panel.get("options", {}), f"{where}/options")
            custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {})
            found += errors("timeseries_field_config", custom, f"{where}/fieldConfig")
    return found


def main() -> int:
    if len(sys.argv) != 2:
        print(f"usage: python {sys.argv[0]} DASHBOARD.json", file=sys.stderr)
        return 2
    found = problems(json.loads(Path(sys.argv[1]).read_text()), schemas())
    print("\n".join(found) or f"{sys.argv[1]} matches {GRAFANA_SCHEMA}'s dashboard types")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
