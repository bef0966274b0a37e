package tokens

import (
	"encoding/json"
	"fmt"
	"sort"
	"strings"
)

// The API does not show the model the tools' JSON: it renders them as
// TypeScript-like declarations in the system message, roughly
//
//	namespace functions {
//
//	// Get the weather
//	type get_weather = (_: {
//	// City name
//	city: string,
//	unit?: "c" | "f",
//	}) => any;
//
//	} // namespace functions
//
// (the form reverse-engineered by hmarr/openai-chat-tokens from API counts;
// OpenAI's cookbook num_tokens_for_tools counts the same pieces). Counting
// the JSON instead overshoots two to three times on real requests, whose
// schemas carry "type", "additionalProperties" and "strict" keys the model
// never sees. renderTools writes that form; parts of a schema it does not
// model (references, combinators it cannot flatten) are written as their
// compact JSON, which errs high.

// tool is one entry of a chat completion request's "tools" array.
type tool struct {
	Type     string `json:"type"`
	Function struct {
		Name        string          `json:"name"`
		Description string          `json:"description"`
		Parameters  json.RawMessage `json:"parameters"`
	} `json:"function"`
}

// schema is the part of JSON Schema that the rendering understands.
type schema struct {
	Type        any                        `json:"type"` // string or list of strings
	Description string                     `json:"description"`
	Properties  map[string]json.RawMessage `json:"properties"`
	Required    []string                   `json:"required"`
	Items       json.RawMessage            `json:"items"`
	Enum        []any                      `json:"enum"`
	Const       any                        `json:"const"`
	AnyOf       []json.RawMessage          `json:"anyOf"`
	OneOf       []json.RawMessage          `json:"oneOf"`
	Ref         string                     `json:"$ref"`
}

// renderTools renders a "tools" array. It fails only when toolsJSON is not
// an array of objects; the caller then counts the JSON itself.
func renderTools(toolsJSON string) (string, error) {
	var tools []tool
	if err := json.Unmarshal([]byte(toolsJSON), &tools); err != nil {
		return "", fmt.Errorf("tokens: tools: %w", err)
	}
	var b strings.Builder
	b.WriteString("namespace functions {\n\n")
	for _, t := range tools {
		f := t.Function
		if f.Description != "" {
			b.WriteString("// " + f.Description + "\n")
		}
		var s schema
		if len(f.Parameters) > 0 && json.Unmarshal(f.Parameters, &s) == nil && len(s.Properties) == 0 && s.Ref == "" && s.AnyOf == nil && s.OneOf == nil {
			b.WriteString("type " + f.Name + " = () => any;\n\n")
			continue
		}
		b.WriteString("type " + f.Name + " = (_: ")
		writeType(&b, f.Parameters, 0)
		b.WriteString(") => any;\n\n")
	}
	b.WriteString("} // namespace functions")
	return b.String(), nil
}

// writeType writes the TypeScript form of one schema.
func writeType(b *strings.Builder, raw json.RawMessage, depth int) {
	var s schema
	if len(raw) == 0 || json.Unmarshal(raw, &s) != nil {
		b.WriteString("any")
		return
	}
	if s.Ref != "" || depth > 8 {
		compact(b, raw)
		return
	}
	switch {
	case s.Const != nil:
		writeLiteral(b, s.Const)
		return
	case len(s.Enum) > 0:
		for i, v := range s.Enum {
			if i > 0 {
				b.WriteString(" | ")
			}
			writeLiteral(b, v)
		}
		return
	case len(s.AnyOf) > 0 || len(s.OneOf) > 0:
		alts := append(s.AnyOf, s.OneOf...)
		for i, a := range alts {
			if i > 0 {
				b.WriteString(" | ")
			}
			writeType(b, a, depth+1)
		}
		return
	}
	types := typeNames(s.Type)
	if len(types) == 0 && len(s.Properties) > 0 {
		types = []string{"object"}
	}
	if len(types) == 0 {
		b.WriteString("any")
		return
	}
	for i, t := range types {
		if i > 0 {
			b.WriteString(" | ")
		}
		switch t {
		case "object":
			writeObject(b, s, depth)
		case "array":
			if len(s.Items) == 0 {
				b.WriteString("any[]")
				break
			}
			writeType(b, s.Items, depth+1)
			b.WriteString("[]")
		case "integer", "number":
			b.WriteString("number")
		case "string", "boolean", "null":
			b.WriteString(t)
		default:
			b.WriteString("any")
		}
	}
}

// writeObject writes an object's properties in a stable order (the JSON
// order is lost in a map; the count does not depend on it).
func writeObject(b *strings.Builder, s schema, depth int) {
	if len(s.Properties) == 0 {
		b.WriteString("object")
		return
	}
	names := make([]string, 0, len(s.Properties))
	for n := range s.Properties {
		names = append(names, n)
	}
	sort.Strings(names)
	required := make(map[string]bool, len(s.Required))
	for _, r := range s.Required {
		required[r] = true
	}
	indent := strings.Repeat("  ", depth)
	b.WriteString("{\n")
	for _, n := range names {
		var p schema
		_ = json.Unmarshal(s.Properties[n], &p) // a bad property renders as "any"
		if p.Description != "" {
			b.WriteString(indent + "// " + p.Description + "\n")
		}
		b.WriteString(indent + n)
		if !required[n] {
			b.WriteString("?")
		}
		b.WriteString(": ")
		writeType(b, s.Properties[n], depth+1)
		b.WriteString(",\n")
	}
	b.WriteString(indent + "}")
}

func typeNames(t any) []string {
	switch v := t.(type) {
	case string:
		return []string{v}
	case []any:
		out := make([]string, 0, len(v))
		for _, x := range v {
			if s, ok := x.(string); ok {
				out = append(out, s)
			}
		}
		return out
	}
	return nil
}

func writeLiteral(b *strings.Builder, v any) {
	raw, err := json.Marshal(v)
	if err != nil {
		b.WriteString("any")
		return
	}
	b.Write(raw)
}

// compact writes raw without insignificant white space.
func compact(b *strings.Builder, raw json.RawMessage) {
	var v any
	if json.Unmarshal(raw, &v) != nil {
		b.Write(raw)
		return
	}
	out, _ := json.Marshal(v)
	b.Write(out)
}
