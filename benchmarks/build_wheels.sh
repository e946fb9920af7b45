#!/usr/bin/env bash
# Builds .whl/ (ignored by git): the wheels the device check installs offline on a bare GPU machine whose image
# holds Python 3.12, torch, Triton, pytest, pytest-xdist, einops and packaging but no flash-linear-attention.
#
#   bash benchmarks/build_wheels.sh            # then carry `.whl` with the working tree (benchmarks/gpu_session.sh)
#
# It downloads flash-linear-attention and fla-core (FLA_VERSION, default 0.6.0: the range
# bayeslayer.ops.bayesian_layer.mean_pass_fla calls) as Python 3.12 wheels without their dependencies, then reads each wheel's METADATA and downloads, the same
# way, every requirement that applies without extras and is not already on the image (IMAGE below), until none is
# left.  Binary wheels are refused (--only-binary=:all: with a pure-Python check): the image's platform libraries are
# not ours to replace.  Not carried, by design: transformers (a requirement of flash-linear-attention's models and
# layers only; fla's package init treats them as optional, and fla.ops.gated_delta_rule imports without it).
# Prints the folder's size: it travels with the checkout, so small is better.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
FLA_VERSION=${FLA_VERSION:-0.6.0}
DEST=.whl
# already on the target image (its package list names these and their own requirements)
IMAGE="torch triton pytest pytest-xdist einops packaging numpy filelock typing-extensions sympy networkx jinja2
fsspec setuptools mpmath markupsafe iniconfig pluggy pygments execnet"
OPTIONAL="transformers"
rm -rf "$DEST"
mkdir -p "$DEST"
download() {  # one requirement string, Python 3.12, no dependencies
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "$1"
}
todo=("flash-linear-attention==$FLA_VERSION" "fla-core==$FLA_VERSION")
done_names=" "
while [ ${#todo[@]} -gt 0 ]; do
  req=${todo[0]}
  todo=("${todo[@]:1}")
  name=$(echo "$req" | sed -E 's/[<>=!~; ].*//' | tr 'A-Z_.' 'a-z--')
  case "$done_names" in *" $name "*) continue ;; esac
  done_names="$done_names$name "
  echo "download $req"
  download "$req"
  whl=
  for f in "$DEST"/*.whl; do
    if [ "$(basename "$f" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')" = "$name" ]; then whl=$f; break; fi
  done
  if [ -z "$whl" ]; then echo "build_wheels.sh: no wheel for $req" >&2; exit 1; fi
  case "$(basename "$whl")" in *-none-any.whl) ;; *) echo "build_wheels.sh: $whl is not pure Python" >&2; exit 1 ;; esac
  # its requirements without extras (Requires-Dist lines without an `extra ==` marker)
  while IFS= read -r dep; do
    dname=$(echo "$dep" | sed -E 's/[<>=!~; (\[].*//' | tr 'A-Z_.' 'a-z--')
    if [[ " $(echo $IMAGE) " == *" $dname "* ]]; then echo "  $dep: on the image"; continue; fi
    if [[ " $OPTIONAL " == *" $dname "* ]]; then echo "  $dep: not carried (not needed by fla.ops)"; continue; fi
    todo+=("$(echo "$dep" | sed -E 's/ *;.*//; s/ *\((.*)\)/\1/; s/ //g')")
  done < <("$PY" -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); print(z.read(next(n for n in z.namelist()
if n.endswith('.dist-info/METADATA'))).decode())" "$whl" | grep '^Requires-Dist:' | grep -v 'extra ==' \
           | sed 's/^Requires-Dist: *//')
done
ls -l "$DEST"
echo "$DEST: $(du -sk "$DEST" | cut -f1) KiB in $(ls "$DEST"/*.whl | wc -l) wheels"
