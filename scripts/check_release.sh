#!/usr/bin/env bash
# A release as a user gets it: the wheel builds, installs into a fresh venv (torch and Triton from the index, the
# rest from the wheel's own requirements), `warpforge --version` and `import warpforge` work there; the API
# reference builds from the docstrings. Run by .ci/run; needs network access to the package index, like CI.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" .
python -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --upgrade pip
"$work/venv/bin/pip" install -q torch==2.13.0
"$work/venv/bin/pip" install -q "$work"/dist/warpforge-*.whl
(cd "$work" && "$work/venv/bin/warpforge" --version && "$work/venv/bin/python" -c \
  "import warpforge, pathlib; print('import warpforge', warpforge.__version__, 'typed:',
        (pathlib.Path(warpforge.__file__).parent / 'py.typed').exists())")
mkdocs build --strict -q -d "$work/site" && echo "docs: built $(find "$work/site" -name '*.html' | wc -l) pages"
