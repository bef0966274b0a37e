package offline

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"sync"
)

// BaseURL is the base URL the offline model is reached at through Client:
// a name that never resolves, so a request meant for it cannot leave the
// process by mistake.
const BaseURL = "http://offline-model.invalid/v1"

// Client returns an *http.Client whose Transport serves the wire handler
// in process: the gateway relays the offline model's answers, streams
// included, through the same code as a real provider's.
func Client() *http.Client { return &http.Client{Transport: HandlerTransport(NewWire())} }

// HandlerTransport is an http.RoundTripper that serves h in process. The
// response is returned as soon as h writes its header (or its first
// byte), and its body streams what h writes next; closing the body or
// ending the request's context stops h's writes.
func HandlerTransport(h http.Handler) http.RoundTripper { return handlerTransport{h} }

type handlerTransport struct{ h http.Handler }

func (t handlerTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx, cancel := context.WithCancel(req.Context())
	pr, pw := io.Pipe()
	rw := &pipeResponse{header: http.Header{}, pw: pw, ready: make(chan struct{})}
	stop := context.AfterFunc(ctx, func() { pr.CloseWithError(ctx.Err()) })
	go func() {
		defer func() {
			switch p := recover(); {
			case p != nil:
				pw.CloseWithError(fmt.Errorf("offline: handler panicked: %v", p))
			case ctx.Err() != nil:
				// A handler that stopped because the request was cancelled
				// did not finish its answer: the reader gets the context's
				// error, as from a network transport, and not an EOF that
				// would pass a cut answer for a whole one (stop's AfterFunc,
				// which closes the reader with that error, may run after this).
				pw.CloseWithError(ctx.Err())
			default:
				pw.Close()
			}
			rw.writeHeader(http.StatusOK) // a handler that wrote nothing
			if req.Body != nil {
				req.Body.Close()
			}
		}()
		t.h.ServeHTTP(rw, req.WithContext(ctx))
	}()
	select {
	case <-rw.ready:
	case <-ctx.Done():
		cancel()
		return nil, ctx.Err()
	}
	return &http.Response{
		Status:     fmt.Sprintf("%d %s", rw.status, http.StatusText(rw.status)),
		StatusCode: rw.status, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: rw.sent, Body: &pipeBody{pr: pr, ctx: ctx, stop: stop, cancel: cancel},
		ContentLength: -1, Request: req,
	}, nil
}

// pipeResponse is the handler's side: its header is fixed when written,
// its body goes into the pipe.
type pipeResponse struct {
	header http.Header
	sent   http.Header
	status int
	pw     *io.PipeWriter
	once   sync.Once
	ready  chan struct{}
}

func (p *pipeResponse) Header() http.Header { return p.header }

func (p *pipeResponse) writeHeader(code int) {
	p.once.Do(func() {
		p.status, p.sent = code, p.header.Clone()
		close(p.ready)
	})
}

func (p *pipeResponse) WriteHeader(code int) { p.writeHeader(code) }

func (p *pipeResponse) Write(b []byte) (int, error) {
	p.writeHeader(http.StatusOK)
	return p.pw.Write(b)
}

// Flush is what http.ResponseController finds: the pipe holds nothing, a
// write returns when the reader has it.
func (p *pipeResponse) Flush() {}

type pipeBody struct {
	pr     *io.PipeReader
	ctx    context.Context
	stop   func() bool
	cancel context.CancelFunc
}

// Read reports a cancelled request as the context's error, as a network
// transport does, rather than the closed pipe it leaves.
func (b *pipeBody) Read(p []byte) (int, error) {
	n, err := b.pr.Read(p)
	if err != nil && err != io.EOF && b.ctx.Err() != nil {
		err = b.ctx.Err()
	}
	return n, err
}

func (b *pipeBody) Close() error {
	b.stop()
	b.cancel()
	return b.pr.Close()
}
