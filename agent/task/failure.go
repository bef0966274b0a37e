package task

import "errors"

// Failure ends a task with a code of the vocabulary (agent_failed,
// model_unavailable, input_spike, token_rate_limited, …) and a sentence
// for the visitor: what the built-in planner, the governed call and the
// remote executor return when a task cannot go on.
type Failure struct {
	Code    string
	Message string
}

func (f *Failure) Error() string { return f.Code + ": " + f.Message }

// Fail is a Failure with code and the visitor's message.
func Fail(code, msg string) error { return &Failure{Code: code, Message: msg} }

// FailureOf reads the code and the visitor's message of a Failure in
// err's chain; ok is false for any other error (a context's end, a bug),
// which the caller maps itself.
func FailureOf(err error) (code, msg string, ok bool) {
	var f *Failure
	if !errors.As(err, &f) {
		return "", "", false
	}
	return f.Code, f.Message, true
}
