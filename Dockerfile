# Multi-stage build: a static binary in a minimal, non-root image.
# No secrets are baked in: configure with FAREGATE_* environment variables
# (docker run --env-file .env, from a copy of .env.example).
#
#   docker build --build-arg VERSION=$(git describe --tags --always --dirty) -t faregate .
#
# Base images are pinned by exact tag, not by digest: the machine this file
# was written on could not reach a registry to resolve the digests. Before a
# release, pin them: `docker buildx imagetools inspect golang:1.26.8-bookworm`
# prints the index digest; write it as golang:1.26.8-bookworm@sha256:…, and
# the same for the distroless image (whose :nonroot tag moves with each
# Debian security update).
FROM golang:1.26.8-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
# .dockerignore keeps .git, every .env but the example, and test binaries out.
COPY . .
# The version faregate reports (`faregate version`, faregate_build_info, the
# agent's User-Agent). .git is not in the context, so without it the binary
# says "dev".
ARG VERSION=dev
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" -o /out/faregate ./cmd/faregate

FROM gcr.io/distroless/static-debian12:nonroot
ARG VERSION=dev
LABEL org.opencontainers.image.title="faregate" \
      org.opencontainers.image.version="${VERSION}"
COPY --from=build /out/faregate /faregate
# Listen on all interfaces inside the container. With embedded defaults this
# refuses to start unless FAREGATE_DEV=true (a throwaway demo) is also set.
ENV FAREGATE_ADDR=0.0.0.0:8080
EXPOSE 8080
USER nonroot:nonroot
# Distroless has no shell or curl: the binary probes its own /healthz (a
# wildcard FAREGATE_ADDR is probed on loopback).
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 CMD ["/faregate","health"]
# SIGTERM drains: running tasks get FAREGATE_SHUTDOWN_TIMEOUT (20s), then
# event streams end with their final events. docker stop waits only 10s by
# default: run with --stop-timeout 30 (compose: stop_grace_period: 30s).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/faregate"]
