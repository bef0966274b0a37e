package gateway

// A provider's refusal to answer (its content rules) is an invalid request
// of the caller's as much as a refused prompt is: the invalid ratio counts
// it (govern.Outcome.Refused). What says so is read from what each relay already
// decodes: a chat choice's finish_reason "content_filter" or a refusal in
// its message or delta; a Responses answer's incomplete_details.reason
// "content_filter", or refusal content in its output.

// reasonContentFilter is the finish and incomplete reason of an answer
// the provider's content rules stopped.
const reasonContentFilter = "content_filter"

// chatRefused reports whether a chat choice (finish reason, message or
// delta) is the provider's refusal.
func chatRefused(finish *string, d *chatDelta) bool {
	return finish != nil && *finish == reasonContentFilter || d.Refusal != nil && *d.Refusal != ""
}

// respRefused reports whether a Responses answer is the provider's
// refusal: stopped by its content rules, or answering with refusal
// content.
func respRefused(incomplete *respIncomplete, output []respItem) bool {
	if incomplete != nil && incomplete.Reason == reasonContentFilter {
		return true
	}
	for _, it := range output {
		for _, p := range it.Content {
			if p.Refusal != "" {
				return true
			}
		}
	}
	return false
}

// respIncomplete is a Responses answer's incomplete_details.
type respIncomplete struct {
	Reason string `json:"reason"`
}
