# Shortcuts. The README's own commands stay `sudo ./scripts/run` and `./scripts/test`.
#   make deb    the Debian package: dist/devplugd_<version>_<arch>.deb (packaging/deb/build;
#               as root it installs missing build dependencies with apt-get)
#   make image  the OCI image localhost/devplugd:<version>, from that .deb on a debootstrapped
#               bookworm (packaging/image/build; root, podman and debootstrap)
#   make test   ./scripts/test
#   make run    ./scripts/run (needs root)
#   make clean  removes dist/

.PHONY: deb image test run clean

deb:
	./packaging/deb/build

image:
	./packaging/image/build

test:
	./scripts/test

run:
	./scripts/run

clean:
	rm -rf dist
