package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime/debug"
	"strings"
	"time"
)

// version is stamped at build time (-ldflags "-X main.version=v1.2.3");
// otherwise versionString falls back to what the Go toolchain recorded.
var version = "dev"

// versionString is the version faregate reports: the stamped one, else the
// module version or VCS revision of the build, else "dev".
func versionString() string {
	if version != "dev" && version != "" {
		return version
	}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "dev"
	}
	if v := bi.Main.Version; v != "" && v != "(devel)" {
		return v
	}
	var rev, modified string
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			modified = s.Value
		}
	}
	if rev == "" {
		return "dev"
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	if modified == "true" {
		rev += "-dirty"
	}
	return "dev-" + rev
}

// runVersion implements `faregate version` and `--version`.
func runVersion(stdout io.Writer) error {
	bi, _ := debug.ReadBuildInfo()
	goVersion := "unknown"
	if bi != nil {
		goVersion = bi.GoVersion
	}
	_, err := fmt.Fprintf(stdout, "faregate %s (%s)\n", versionString(), goVersion)
	return err
}

// runHealth implements `faregate health`, for a container HEALTHCHECK
// (distroless images have no shell or curl): it exits 0 when /healthz of
// FAREGATE_ADDR answers 200 within the timeout. A wildcard listen address
// is probed on loopback.
func runHealth(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	addr := getenv("FAREGATE_ADDR")
	if addr == "" {
		addr = "127.0.0.1:8080"
	}
	if len(args) > 0 {
		addr = args[0]
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("health: FAREGATE_ADDR %q: want host:port", addr)
	}
	switch strings.Trim(host, "[]") {
	case "", "0.0.0.0":
		host = "127.0.0.1"
	case "::":
		host = "::1"
	}
	url := "http://" + net.JoinHostPort(strings.Trim(host, "[]"), port) + "/healthz"
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("health: %w", err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("health: %s: %w", url, err)
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("health: %s answered %d", url, resp.StatusCode)
	}
	_, err = fmt.Fprintf(stdout, "healthy: %s\n", url)
	return err
}
