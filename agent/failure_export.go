package agent

// Fail is a terminal error with a task code and the visitor's sentence,
// as FailureCode reads it: for executors other than the Workflow (the
// remote executor of an external agent).
func Fail(code, msg string) error { return &failure{code: code, msg: msg} }
