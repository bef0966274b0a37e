package api

import (
	"bytes"
	_ "embed"
)

// openAPIDocument is the OpenAPI 3.1 description of every /api path,
// written by hand; api/apitest validates live responses against it, so a
// change of the API that is not written here fails the end-to-end tests.
//
//go:embed openapi.json
var openAPIDocument []byte

// OpenAPIDocument returns the OpenAPI 3.1 document served at
// GET /api/openapi.json. Each call gets its own copy, so no caller can
// change what the next one serves.
func OpenAPIDocument() []byte {
	return bytes.Clone(openAPIDocument)
}
