# Sourced by scripts/image-base.sh, scripts/image.sh and scripts/image_test.py (not run): the container engine
# made ready, or one line naming the step that is missing (docs/operators.md, "The image without a registry").
#
# Sourcing it turns a relative CONTAINERS_CONF into an absolute path (podman's build steps resolve it from
# another directory: "stat scripts/containers-sandbox.conf: no such file"), so source it before any cd.

if [ -n "${CONTAINERS_CONF:-}" ]; then
    if [ ! -f "$CONTAINERS_CONF" ]; then
        echo "CONTAINERS_CONF=$CONTAINERS_CONF: no such file (from $(pwd))" >&2
        exit 1
    fi
    CONTAINERS_CONF="$(realpath "$CONTAINERS_CONF")"
    export CONTAINERS_CONF
fi
SANDBOX_CONF="$(realpath "$(dirname "${BASH_SOURCE[0]}")/containers-sandbox.conf")"

# podman where it is installed, else docker.
default_engine() {
    command -v podman >/dev/null && echo podman || echo docker
}

# engine_ready WHO ENGINE [IMAGE]: the engine answers, IMAGE (if given) is here and a container of it starts;
# otherwise one line, prefixed with WHO, saying what to do, and a non-zero return.
engine_ready() {
    local who="$1" engine="$2" image="${3:-}" out
    if ! command -v "$engine" >/dev/null; then
        echo "$who: $engine is not installed (apt-get install -y podman buildah uidmap fuse-overlayfs)" >&2
        return 1
    fi
    if ! out="$("$engine" info 2>&1 >/dev/null)"; then
        if grep -q 'OCI runtime "runc" not found' <<<"$out"; then
            echo "$who: $engine is set to use runc (CONTAINERS_CONF=${CONTAINERS_CONF:-}), which is not installed:" \
                 "apt-get install -y runc" >&2
        else
            echo "$who: $engine info fails: $(head -n 1 <<<"$out")" >&2
        fi
        return 1
    fi
    [ -n "$image" ] || return 0
    if ! "$engine" image inspect "$image" >/dev/null 2>&1; then
        return 2  # the caller says how this image is made
    fi
    if ! out="$("$engine" run --rm --network none --entrypoint true "$image" 2>&1)"; then
        local hint="export CONTAINERS_CONF=$SANDBOX_CONF (runc, and limits the sandbox allows; apt-get install -y runc)"
        [ "${CONTAINERS_CONF:-}" = "$SANDBOX_CONF" ] && hint="$engine's runtime is refused even with $SANDBOX_CONF"
        echo "$who: $engine cannot start a container of $image here ($(grep -m 1 . <<<"$out")): $hint" >&2
        return 1
    fi
}
