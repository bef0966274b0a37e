# Multi-stage build: a static binary in a minimal, non-root image.
# No secrets are baked in: configure with FAREGATE_* environment variables.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" -o /out/faregate ./cmd/faregate

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/faregate /faregate
# Listen on all interfaces inside the container. With embedded defaults this
# refuses to start unless FAREGATE_DEV=true (a throwaway demo) is also set.
ENV FAREGATE_ADDR=0.0.0.0:8080
EXPOSE 8080
USER nonroot:nonroot
ENTRYPOINT ["/faregate"]
