package web

// ParseTables lets contract_test.go (package web_test, which may import
// the api packages) read the message tables.
var ParseTables = parseTables
