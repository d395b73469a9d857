#!/usr/bin/env bash
# bash scripts/device_wheels.sh            # wheels for the lent GPU machine (Python 3.12) into .whl/
# PYTHON_VERSION=3.11 WHEEL_DIR=/tmp/w bash scripts/device_wheels.sh   # the same pins for a 3.11 dry run
#
# The lent GPU machine (the device tool's KINDS.md) has Python 3.12, torch,
# transformers, accelerate, safetensors, tokenizers, numpy, pyarrow, pandas, pyyaml, tqdm, requests,
# fsspec, xxhash, huggingface_hub … but no datasets or blake3, and it cannot reach a
# package registry. This script, run where pip reaches one, downloads exactly the wheels it lacks,
# one pinned version each, into the git-ignored .whl/; scripts/device_check.sh installs them there
# with `pip install --no-index --no-deps --target` (both ends without dependency resolution, so
# every dependency is named here, after its Requires-Dist):
#   datasets      needs dill and multiprocess, missing there (filelock, numpy, pyarrow, pandas, tqdm,
#                 xxhash, fsspec, huggingface-hub, packaging, pyyaml are in the image)
#   blake3        nothing on Python ≥ 3.12
# wandb is left out: its wheel alone is 20 MB (0.31.0; it also needs cwevals, platformdirs and
# three OpenTelemetry packages with their own dependencies, none in the image) and the working
# tree is ~33 MiB, against 64 MiB for everything that travels; the check logs with
# `--report_to jsonl`, which never imports wandb.
# The pins are the versions the project's tests pass with here (the shared .venv).
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=${WHEEL_DIR:-.whl}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
WHEELS=(
    datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
    blake3==1.0.11
)
# pip matches each manylinux tag exactly: these cover every glibc x86-64 wheel up to 2.28.
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

rm -rf "$DIR"  # one version of each: a wheel left from an older pin would stop the whole install there
mkdir -p "$DIR"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d "$DIR" "${WHEELS[@]}"
if [[ $(find "$DIR" -type f -name '*.whl' | wc -l) -ne ${#WHEELS[@]} ]]; then
    echo "device_wheels.sh: expected ${#WHEELS[@]} wheels in $DIR, found:" >&2
    ls "$DIR" >&2
    exit 1
fi
# Every dependency a wheel declares (extras aside, markers read for the target Python) is another
# wheel here or one of IMAGE_HAS, the image's packages they need (KINDS.md's list): a new pin that
# brings a new dependency stops here, not on the GPU machine.
IMAGE_HAS="filelock numpy pyarrow pandas tqdm xxhash fsspec huggingface-hub packaging pyyaml"
python3 - "$DIR" "$PYTHON_VERSION" "$IMAGE_HAS" <<'PY'
import sys, zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

folder, python, image = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split()
have = {canonicalize_name(w.name.split("-")[0]) for w in folder.glob("*.whl")} | {canonicalize_name(n) for n in image}
environment = {"python_version": python, "python_full_version": f"{python}.0", "extra": ""}
missing = []
for wheel in sorted(folder.glob("*.whl")):
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if (req.marker is None or req.marker.evaluate(environment)) and canonicalize_name(req.name) not in have:
                missing.append(f"{wheel.name}: {req}")
if missing:
    sys.exit("device_wheels.sh: dependencies neither in the wheels nor in the image:\n  " + "\n  ".join(missing))
PY
du -sh "$DIR"
