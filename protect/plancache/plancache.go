// Package plancache keeps the plans of succeeded tasks in Redis, keyed by a
// normalised request, so that a visitor who would otherwise be refused
// (budget exhausted, model down) can be answered with a plan already made
// for the same trip (#10).
//
// The key is built from the request alone (destination, days, interests,
// answer language), never from the visitor or principal who asked, so a
// stored plan says nothing about anyone. Whether and when a cached plan is
// served is the gate's decision; this package only parses the mode, builds
// the key and stores and loads plans. Any Redis failure is ErrUnavailable:
// the caller then answers as it would have without a cache, so a cache
// failure can never admit a request nor hide the refusal it replaced.
package plancache
