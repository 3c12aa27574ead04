# Sourced by packaging/deb/build and packaging/image/build: running another architecture's
# Debian binaries on this machine with qemu-user, through the kernel's binfmt_misc.
#
# Debian's qemu-user-static registers its emulators (with binfmt-support) with the F flag: the
# kernel opens the static emulator once, at registration, so a chroot of another architecture
# (debootstrap --arch, apt-get, dpkg-buildpackage, podman build --platform) runs without a copy
# of qemu inside it. On a machine booted without systemd, nothing mounts binfmt_misc or enables
# the entries: foreign_setup does both.

# Debian architecture -> the CPU name of qemu's emulator and of the ELF objects (uname -m).
foreign_cpu() {
    case "$1" in
        amd64) echo x86_64 ;;
        arm64) echo aarch64 ;;
        *) echo "unsupported architecture $1 (amd64, arm64)" >&2; return 1 ;;
    esac
}

# Make binaries of Debian architecture $1 run here; a no-op for this machine's own.
foreign_setup() {
    local arch=$1 cpu entry
    [ "$arch" != "$(dpkg --print-architecture)" ] || return 0
    cpu=$(foreign_cpu "$arch")
    entry=/proc/sys/fs/binfmt_misc/qemu-$cpu
    if ! command -v update-binfmts >/dev/null || [ ! -e "/usr/libexec/qemu-binfmt/$cpu-binfmt-P" ]; then
        [ "$(id -u)" -eq 0 ] || { echo "foreign: apt-get install qemu-user-static binfmt-support (as root)" >&2; return 1; }
        echo "foreign: installing qemu-user-static binfmt-support"
        DEBIAN_FRONTEND=noninteractive apt-get -qq update
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends \
            qemu-user-static binfmt-support >/dev/null
    fi
    if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    fi
    if [ ! -e "$entry" ] || ! grep -qx enabled "$entry"; then
        update-binfmts --import "qemu-$cpu" 2>/dev/null || true
        update-binfmts --enable "qemu-$cpu"
    fi
    grep -qx enabled "$entry" || { echo "foreign: $entry is not enabled" >&2; return 1; }
    grep -q '^flags: .*F' "$entry" ||
        { echo "foreign: $entry lacks the F flag (a chroot could not find the emulator)" >&2; return 1; }
}

# Run "$@" chrooted into $1, in a private mount namespace (the mounts go with the process): proc,
# the host's /dev, an empty /run, the host's resolv.conf; the proxy and pip settings of the
# environment are passed on, and pip (and Python's ssl) trust the CA certificates the host's pip
# trusts (a proxy's or a mirror's CA too): the host's bundle is copied to /run, which is not kept.
foreign_chroot() {
    local root=$1 name bundle
    shift
    local -a pass=()
    for name in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY $(compgen -e | grep '^PIP_' || true); do
        [ -z "${!name+x}" ] || pass+=("$name=${!name}")
    done
    bundle=${PIP_CERT:-${REQUESTS_CA_BUNDLE:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}}
    if [ -f "$bundle" ]; then
        pass+=(PIP_CERT=/run/host-ca-certificates.crt SSL_CERT_FILE=/run/host-ca-certificates.crt
               REQUESTS_CA_BUNDLE=/run/host-ca-certificates.crt)
    else
        bundle=""
    fi
    # shellcheck disable=SC2016  # expanded by the inner shell
    unshare --mount --propagation private sh -c '
        set -e
        root=$1; bundle=$2; shift 2
        mount -t proc proc "$root/proc"
        mount --rbind /dev "$root/dev"
        mount -t tmpfs -o mode=0755 tmpfs "$root/run"
        cp /etc/resolv.conf "$root/etc/resolv.conf"
        [ -z "$bundle" ] || cp "$bundle" "$root/run/host-ca-certificates.crt"
        exec chroot "$root" "$@"' sh "$root" "$bundle" \
        env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C.UTF-8 HOME=/root DEBIAN_FRONTEND=noninteractive \
        "${pass[@]}" "$@"
}
