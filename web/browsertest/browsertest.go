// Package browsertest starts the headless Chromium that the page's browser
// tests drive, the same way for every package. Those tests are heavy, so
// they run only with FAREGATE_BROWSER_TESTS=1 (.ci/run sets it); once asked
// for, a missing Chromium fails the test under CI=true and skips it elsewhere.
package browsertest

import (
	"context"
	"os"
	"os/exec"
	"testing"

	"github.com/chromedp/chromedp"
)

// Env is the variable that turns the browser tests on.
const Env = "FAREGATE_BROWSER_TESTS"

// Start skips the test unless Env=1, then launches one headless Chromium
// with a fresh profile and returns a browser context (new tabs come from
// chromedp.NewContext on it). The browser ends with the test.
func Start(t *testing.T) context.Context {
	t.Helper()
	if os.Getenv(Env) != "1" {
		t.Skipf("set %s=1 to drive the page in headless Chromium", Env)
	}
	path := ""
	for _, name := range []string{"chromium", "chromium-browser", "/usr/bin/chromium"} {
		if p, err := exec.LookPath(name); err == nil {
			path = p
			break
		}
	}
	if path == "" {
		if os.Getenv("CI") == "true" {
			t.Fatal("Chromium (chromium or chromium-browser) is not installed")
		}
		t.Skip("Chromium (chromium or chromium-browser) is not installed")
	}
	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(path),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.Flag("headless", true),
		chromedp.Flag("no-sandbox", true),
		chromedp.Flag("disable-gpu", true),
		// Without these Chromium dials Google's services at start, which a
		// closed network refuses many times over.
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("no-first-run", true),
		chromedp.Flag("disable-quic", true),
		// Containers often have a tiny /dev/shm; Chromium crashes when it fills.
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("hide-scrollbars", true),
		chromedp.Flag("mute-audio", true),
	}
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	t.Cleanup(cancelAlloc)
	ctx, cancel := chromedp.NewContext(alloc)
	t.Cleanup(cancel)
	// Start the browser once, without a deadline: chromedp ties the
	// browser's life to the first context that runs an action.
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("starting %s: %v", path, err)
	}
	return ctx
}
