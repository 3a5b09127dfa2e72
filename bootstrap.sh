# Sourced by run-default.sh and run-tests.sh: a Python environment with this project installed.
#   MEGATRAIN_EXTRAS  pip extras to install ("" or "test")
# Inside a virtual environment (or a conda env other than base) it installs there; otherwise into a
# project environment, .venv/, which sees the system's packages (an installed torch is reused) but
# never changes them, and works where the system Python refuses pip (PEP 668). A second run with the
# same pyproject.toml installs nothing. Sets PY to the environment's python.

say() { echo "[megatrain setup] $*" >&2; }

_pip_progress() {  # pip with one line per package instead of a screenful of "already satisfied"
    "$PY" -m pip install --disable-pip-version-check "$@" 2>&1 \
        | grep --line-buffered -E '^(Collecting|Downloading|Installing|Successfully|ERROR)' \
        | sed -u 's/^/    /' >&2
    return "${PIPESTATUS[0]}"
}

_in_env() {
    [ -n "${VIRTUAL_ENV:-}" ] && return 0
    [ -n "${CONDA_PREFIX:-}" ] && [ "${CONDA_DEFAULT_ENV:-base}" != "base" ] && return 0
    python3 -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null
}

_has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

_install_torch() {
    if _has_gpu; then
        say "installing torch (a GPU is present: the default build, with CUDA)"
        _pip_progress torch && return 0
        return 1
    fi
    say "installing torch, CPU build (no GPU here: no multi-GB CUDA download)"
    _pip_progress --timeout 15 --retries 1 --index-url https://download.pytorch.org/whl/cpu torch && return 0
    say "the CPU wheel index cannot be reached; using what the configured package index offers"
    if "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps torch >/dev/null 2>&1; then
        say "  found a local torch wheel (pip find-links); its dependencies come from the package index"
    fi
    _pip_progress torch
}

megatrain_env() {
    local root stamp want
    root="$(pwd)"
    if _in_env; then
        PY="$(command -v python3)"
        [ -n "${VIRTUAL_ENV:-}" ] && PY="$VIRTUAL_ENV/bin/python"
        stamp="$("$PY" -c 'import sys; print(sys.prefix)')/.megatrain-setup"
    else
        PY="$root/.venv/bin/python"
        if [ ! -x "$PY" ]; then
            say "creating the project environment .venv/ (the system's packages stay untouched)"
            python3 -m venv --system-site-packages "$root/.venv" || {
                say "error: cannot create a virtual environment; on Debian/Ubuntu: sudo apt install python3-venv"
                return 1
            }
        fi
        stamp="$root/.venv/.megatrain-setup"
    fi
    # The stamp: "<hash of pyproject.toml and setup.py> <root>", then one line per extras set installed ("-" for none).
    want="$(cat "$root/pyproject.toml" "$root/setup.py" | sha256sum | cut -c1-16) $root"
    local extras="${MEGATRAIN_EXTRAS:--}"
    if [ -f "$stamp" ] && [ "$(head -1 "$stamp")" = "$want" ] \
        && { [ "$extras" = "-" ] || tail -n +2 "$stamp" | grep -qx "$extras"; } \
        && "$PY" -c 'import megatrain, torch' 2>/dev/null; then
        return 0  # set up by an earlier run with this very pyproject.toml
    fi
    "$PY" -c 'import torch' 2>/dev/null || _install_torch || { say "error: installing torch failed"; return 1; }
    local target="."
    [ "$extras" != "-" ] && target=".[$extras]"
    say "installing MegaTrain and its dependencies into $("$PY" -c 'import sys; print(sys.prefix)')"
    _pip_progress -e "$target" || { say "error: installing MegaTrain failed"; return 1; }
    if [ -f "$stamp" ] && [ "$(head -1 "$stamp")" = "$want" ]; then
        echo "$extras" >> "$stamp"
    else
        printf '%s\n%s\n' "$want" "$extras" > "$stamp"
    fi
    say "ready"
}
