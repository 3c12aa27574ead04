# Shortcuts. The README's own commands stay `sudo ./scripts/run` and `./scripts/test`.
#   make deb    the Debian package: dist/devplugd_<version>_<arch>.deb (packaging/deb/build;
#               as root it installs missing build dependencies with apt-get)
#   make image  the OCI image localhost/devplugd:<version>-<arch>, from that .deb on a
#               debootstrapped bookworm, added to the manifest list localhost/devplugd:<version>
#               (packaging/image/build; root, podman and debootstrap)
#   make deb ARCH=arm64, make image ARCH=arm64: the same for arm64, under qemu-user emulation
#   make test   ./scripts/test
#   make run    ./scripts/run (needs root)
#   make clean  removes dist/

# ARCH: the Debian architecture to build for, this machine's by default; another one (arm64 on
# amd64) is built under qemu-user emulation (packaging/foreign.sh).
ARCH ?= $(shell dpkg --print-architecture)

.PHONY: deb image test run clean

deb:
	ARCH=$(ARCH) ./packaging/deb/build

image:
	ARCH=$(ARCH) ./packaging/image/build

test:
	./scripts/test

run:
	./scripts/run

clean:
	rm -rf dist
