package task

import "encoding/json"

// promptRequest is the prompt form's shape of a Request.
type promptRequest struct {
	Prompt   string `json:"prompt"`
	Language string `json:"language"`
}

// tripRequest is Request without its methods, so MarshalJSON can encode
// the trip shape without calling itself.
type tripRequest Request

// MarshalJSON writes a prompt request as {"prompt", "language"} (the shape
// the page, GET /api/tasks/{id} and an external agent's delivery show) and
// a trip as {"destination", "days", "interests", "language"}. Decoding
// needs no method: each shape fills its own fields.
func (r Request) MarshalJSON() ([]byte, error) {
	if r.Prompt != "" {
		return json.Marshal(promptRequest{Prompt: r.Prompt, Language: r.Lang()})
	}
	return json.Marshal(tripRequest(r))
}
