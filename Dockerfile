# One image for every Pygmy service: `pygmy serve frontend|catalog|order --id K`.
#
# On a normal machine `docker compose up` builds FROM python:3.11-slim and installs from PyPI.
# Offline (no container registry, no network in the build), `bash scripts/compose.sh build` passes
# BASE_IMAGE=pygmy-base:bookworm (made by scripts/build-base-image.sh) and puts wheels built on the host
# into build/wheels; then this build installs with `pip --no-index` and runs with `--network none`.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# Lets scripts/compose.sh prune old, untagged build stages.
LABEL pygmy.build-stage="true"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY . .
RUN python3 -m venv /opt/pygmy \
 && if ls build/wheels/pygmy-*.whl >/dev/null 2>&1; then \
        echo "installing offline from build/wheels" \
        && /opt/pygmy/bin/pip install --no-index --find-links build/wheels pygmy; \
    else \
        echo "no host-built wheels: installing from the package index" \
        && /opt/pygmy/bin/pip install .; \
    fi \
 && /opt/pygmy/bin/pygmy --help >/dev/null

FROM ${BASE_IMAGE}
LABEL pygmy.image="true" \
      org.opencontainers.image.title="pygmy" \
      org.opencontainers.image.description="Pygmy replicated bookstore: frontend, catalog and order services"
RUN (getent group pygmy >/dev/null || groupadd --system --gid 10001 pygmy) \
 && (id -u pygmy >/dev/null 2>&1 || useradd --system --uid 10001 --gid pygmy --home-dir /data \
        --no-create-home --shell /usr/sbin/nologin pygmy) \
 && mkdir -p /data && chown pygmy:pygmy /data
COPY --from=build /opt/pygmy /opt/pygmy
COPY scripts/healthcheck.py /opt/pygmy/healthcheck.py
ENV PATH=/opt/pygmy/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYGMY_BIND=0.0.0.0 \
    PYGMY_PORT=8000 \
    PYGMY_DATA_DIR=/data
USER pygmy
WORKDIR /data
EXPOSE 8000
HEALTHCHECK --interval=3s --timeout=3s --start-period=300s --retries=3 \
    CMD ["/opt/pygmy/bin/python", "/opt/pygmy/healthcheck.py"]
ENTRYPOINT ["pygmy"]
CMD ["serve", "frontend", "--id", "1"]
