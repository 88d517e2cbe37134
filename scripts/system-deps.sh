#!/bin/sh
# System packages for the tests that run real launchers: Open MPI (tests/launch/test_mpi.py) and
# Slurm with munge; then mpi4py, built against that Open MPI, into the virtualenv.
#   scripts/system-deps.sh [PYTHON]      (make sysdeps; PYTHON defaults to .venv/bin/python)
# Installs only what is missing, so a second run costs a few dpkg queries. Without root or apt-get it
# installs nothing and says what it skipped: those tests then skip, naming what they need.
set -eu

PY=${1:-.venv/bin/python}
PACKAGES="openmpi-bin libopenmpi-dev slurm-wlm munge"

missing=""
if command -v dpkg-query >/dev/null 2>&1; then
    for pkg in $PACKAGES; do
        dpkg-query -W -f='${Status}\n' "$pkg" 2>/dev/null | grep -q '^install ok installed$' || missing="$missing $pkg"
    done
else
    for pair in mpirun:openmpi-bin mpicc:libopenmpi-dev slurmctld:slurm-wlm munged:munge; do
        command -v "${pair%%:*}" >/dev/null 2>&1 || missing="$missing ${pair#*:}"
    done
fi

if [ -n "$missing" ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "system-deps: not root, so not installing:$missing (the MPI and Slurm tests skip without them)"
    elif ! command -v apt-get >/dev/null 2>&1; then
        echo "system-deps: no apt-get, so not installing:$missing (the MPI and Slurm tests skip without them)"
    else
        echo "system-deps: installing system packages as root with apt-get:$missing (for the MPI and Slurm tests)"
        export DEBIAN_FRONTEND=noninteractive
        # A fresh machine or container often has no package lists yet.
        # shellcheck disable=SC2086  # one word per package
        apt-get install -y -qq $missing >/dev/null 2>&1 || {
            apt-get update -qq || true
            apt-get install -y -qq $missing ||
                echo "system-deps: apt-get could not install$missing (the tests that need them skip)"
        }
    fi
fi

# mpi4py loads the MPI library at run time, and a build from source needs mpicc: it comes after
# libopenmpi-dev. The version range is the `mpi` extra's (pyproject.toml).
if command -v mpicc >/dev/null 2>&1 && [ -x "$PY" ]; then
    if ! "$PY" -c "import mpi4py" >/dev/null 2>&1; then
        echo "system-deps: installing mpi4py into $(dirname "$(dirname "$PY")")"
        "$PY" -m pip install --quiet 'mpi4py>=3.1' ||
            echo "system-deps: pip could not install mpi4py (the mpi4py test skips)"
    fi
elif ! [ -x "$PY" ]; then
    echo "system-deps: no $PY, so not installing mpi4py (run make setup first)"
else
    echo "system-deps: no mpicc (libopenmpi-dev), so not installing mpi4py (the mpi4py test skips)"
fi
