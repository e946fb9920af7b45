#!/usr/bin/env bash
# The device check's whole line on a CPU, in a venv that holds only what the GPU machine's image holds:
#
#   bash benchmarks/simulate_bare_machine.sh
#
# 1. a venv with no site packages; the image's packages (torch, triton, pytest, pytest-xdist when this machine has
#    it, einops, packaging, numpy, and their own requirements, read from their metadata) are linked in from the
#    Python environment running this script (SOURCE_PYTHON, default python3: its CPU torch and Triton);
#    flash-linear-attention, transformers and everything else are left out;
# 2. .whl/ built by benchmarks/build_wheels.sh when missing (the only step that needs the network), copied with the
#    working tree's tracked and untracked-not-ignored files into a scratch checkout: what travels to the GPU machine;
# 3. benchmarks/gpu_session.sh with DRY_RUN=1 there, pip offline (PIP_NO_INDEX=1) and no network needed: install
#    from .whl, the import check, the scan check and rows (TRITON_INTERPRET=1, tiny shapes), the GPU tests collected
#    and one run, the SASS census (sm_90 compiles work without a GPU);
# 4. its output folder checked: every phase exit 0, the JSON written, every value check within its tolerance.
# Exit 0 when all of that holds.  The interpreter is slow: the phase limits are the device's stretched (SIM_SCAN_S,
# SIM_GPUTEST_S, SIM_CENSUS_S); the device's own plan is what `bash benchmarks/gpu_session.sh` prints there.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SRC_PY=${SOURCE_PYTHON:-python3}
SIM=${SIM_DIR:-/tmp/bl_bare_machine}
rm -rf "$SIM"
mkdir -p "$SIM/image" "$SIM/out"
echo "== 1. venv holding the image's packages only ($SIM/venv)"
"$SRC_PY" - "$SIM/image" <<'EOF'
import importlib.metadata as md
import os
import re
import sys

dest = sys.argv[1]
image = ["torch", "triton", "pytest", "pytest-xdist", "einops", "packaging", "numpy"]
seen, todo, linked = set(), list(image), []
while todo:
    name = re.split(r"[<>=!~;\[ (]", todo.pop())[0].strip().lower().replace("_", "-")
    if not name or name in seen:
        continue
    seen.add(name)
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        print(f"  {name}: not in the source environment, left out")
        continue
    todo += [r for r in (dist.requires or []) if "extra ==" not in r]
    tops = {str(f).split("/")[0] for f in dist.files or [] if not str(f).startswith("..")}
    for top in tops:
        if top.endswith(".pth") or top == "__pycache__" or top.startswith("bin"):
            continue
        src = os.path.join(str(dist.locate_file("")), top)
        if os.path.exists(src) and not os.path.exists(os.path.join(dest, top)):
            os.symlink(src, os.path.join(dest, top))
    linked.append(f"{name} {dist.version}")
print("  linked: " + ", ".join(sorted(linked)))
EOF
"$SRC_PY" -m venv "$SIM/venv"  # pip from the interpreter's own bundled wheel (ensurepip), offline
site=$("$SIM/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$SIM/image" > "$site/image.pth"
if "$SIM/venv/bin/python" -c "import fla" 2>/dev/null; then echo "simulate: fla importable before the install" >&2; exit 1; fi
echo "== 2. wheel folder and checkout"
cd "$ROOT"
if ! ls .whl/*.whl >/dev/null 2>&1; then PYTHON="$SRC_PY" bash benchmarks/build_wheels.sh; fi
mkdir -p "$SIM/repo"
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$SIM/repo"
cp -r .whl "$SIM/repo/.whl"
echo "  $(du -sk "$SIM/repo" | cut -f1) KiB travel"
echo "== 3. the line, dry run"
cd "$SIM/repo"
set +e
env -i PATH="$SIM/venv/bin:/usr/bin:/bin" HOME="$SIM" PIP_NO_INDEX=1 OMP_NUM_THREADS=1 OUT="$SIM/out" \
  SITE="$SIM/site" PYTHON="$SIM/venv/bin/python" DRY_RUN=1 CHECK_S=${SIM_CHECK_S:-900} SCAN_FWD_S=${SIM_FWD_S:-900} \
  FWDBWD_S=${SIM_FWDBWD_S:-1200} GPUTEST_S=${SIM_GPUTEST_S:-600} CENSUS_S=${SIM_CENSUS_S:-900} LINE_S=4800 \
  CENSUS_ARGS="--D 64" \
  bash benchmarks/gpu_session.sh
rc=$?
set -e
echo "== 4. its output ($SIM/out)"
ls -l "$SIM/out"
"$SIM/venv/bin/python" - "$SIM/out" "$rc" <<'EOF'
import json
import sys
from pathlib import Path

out, rc = Path(sys.argv[1]), int(sys.argv[2])
problems = [] if rc == 0 else [f"gpu_session.sh exited {rc}"]
line = json.loads((out / "line.json").read_text())
problems += [f"phase {p['phase']} exit {p['rc']}" for p in line["phases"] if p["rc"]]
scan = {ph: json.loads((out / f"scan_{ph}.json").read_text())["rows"] for ph in ("check", "fwd", "fwdbwd")}
check = next(r for r in scan["check"] if r["kind"] == "check")
problems += [f"check {k}: {v}" for ph in scan for r in scan[ph] if r.get("kind") == "check"
             for k, v in r.items() if k.endswith("_error")]
for key in ("scan_fp64_rel_err", "chain_fp64_rel_err"):
    if not check.get(key, 1) <= 1e-10:
        problems.append(f"check {key}: {check.get(key)}")
bwd = next(r for r in scan["fwdbwd"] if r["kind"] == "check")
for key in ("bl_chain_bwd_fp64_max_rel_err", "bl_scan_bwd_fp64_max_rel_err"):
    if not bwd.get(key, 1) <= 1e-10:
        problems.append(f"backward check {key}: {bwd.get(key)}")
row_checks = [r for r in scan["check"] if r["kind"] == "row_check"]
problems += [f"row check D={r['D']}: {r.get('bl_error') or r.get('gdn_error')}" for r in row_checks
             if "bl_error" in r or "gdn_error" in r]
problems += [f"row check D={r['D']}: BL error {r['bl_fwd_rel_err']:.1e}" for r in row_checks
             if r.get("bl_fwd_rel_err", 1) > 1e-5]
rows = [r for r in scan["fwd"] if r["kind"] in ("latency", "occupancy")]
rows_b = [r for r in scan["fwdbwd"] if r["kind"] in ("latency", "occupancy")]
problems += [f"row {r['kind']} T={r['T']} D={r['D']}: {r.get('error')}" for r in rows if "ratio_fwd" not in r]
problems += [f"row {r['kind']} T={r['T']} D={r['D']}: no forward+backward" for r in rows_b if "ratio_fwdbwd" not in r]
if len(rows_b) != len(rows):
    problems.append(f"{len(rows)} forward rows but {len(rows_b)} forward+backward rows")
if not row_checks or not rows:
    problems.append("no row checks or no rows")
census = json.loads((out / "census.json").read_text())["rows"]
problems += [f"census {r['kernel']}: {r.get('error')}" for r in census if "sass_total" not in r]
if not census:
    problems.append("census: no kernel found on the default path")
print(f"phases: {[(p['phase'], p['rc'], p['seconds']) for p in line['phases']]}")
print(f"row checks: {[(r['D'], r.get('bl_fwd_rel_err'), r.get('gdn_fwd_rel_err')) for r in row_checks]}")
print(f"rows: {len(rows)} with forward and forward+backward; census: {len(census)} kernels")
if problems:
    print("simulate_bare_machine.sh: FAILED: " + "; ".join(problems))
    sys.exit(1)
print("simulate_bare_machine.sh: passed")
EOF
