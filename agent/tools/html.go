package tools

import (
	"strings"
	"unicode"

	"golang.org/x/net/html"
	"golang.org/x/net/html/atom"
)

// skipped elements hold no readable text: code, styling, navigation menus
// and embedded objects.
var skipped = map[atom.Atom]bool{
	atom.Script: true, atom.Style: true, atom.Nav: true, atom.Noscript: true,
	atom.Template: true, atom.Svg: true, atom.Iframe: true, atom.Canvas: true,
	atom.Object: true, atom.Button: true, atom.Select: true, atom.Head: true,
}

// blocks start a new line, so paragraphs and list items do not run together.
var blocks = map[atom.Atom]bool{
	atom.P: true, atom.Div: true, atom.Br: true, atom.Li: true, atom.Ul: true, atom.Ol: true,
	atom.H1: true, atom.H2: true, atom.H3: true, atom.H4: true, atom.H5: true, atom.H6: true,
	atom.Tr: true, atom.Table: true, atom.Section: true, atom.Article: true, atom.Main: true,
	atom.Header: true, atom.Footer: true, atom.Aside: true, atom.Blockquote: true, atom.Pre: true,
	atom.Dl: true, atom.Dt: true, atom.Dd: true, atom.Figure: true, atom.Figcaption: true,
	atom.Hr: true, atom.Address: true, atom.Form: true, atom.Td: true, atom.Th: true,
}

// htmlText extracts the title and the readable text of an HTML document.
// The parser repairs broken markup the way browsers do, so an unclosed
// <nav> cannot swallow the rest of the page unnoticed.
func htmlText(src string) (title, text string) {
	doc, err := html.Parse(strings.NewReader(src))
	if err != nil {
		// html.Parse fails only on reader errors, impossible on a string;
		// fall back to the raw text rather than nothing.
		return "", collapse(src)
	}
	var b strings.Builder
	var walk func(n *html.Node)
	walk = func(n *html.Node) {
		switch n.Type {
		case html.ElementNode:
			if n.DataAtom == atom.Title && title == "" {
				title = strings.Join(strings.Fields(nodeText(n)), " ")
				return
			}
			if skipped[n.DataAtom] {
				// <head> is skipped, but its <title> was wanted above.
				if n.DataAtom == atom.Head {
					for c := n.FirstChild; c != nil; c = c.NextSibling {
						if c.DataAtom == atom.Title {
							walk(c)
						}
					}
				}
				return
			}
			if blocks[n.DataAtom] {
				b.WriteByte('\n')
			}
		case html.TextNode:
			// Source line breaks inside a paragraph are layout, not text:
			// every whitespace run becomes one space, and inline markup
			// (<b>, <a>) joins its neighbours without inventing spaces.
			b.WriteString(squashSpace(n.Data))
		}
		for c := n.FirstChild; c != nil; c = c.NextSibling {
			walk(c)
		}
		if n.Type == html.ElementNode && blocks[n.DataAtom] {
			b.WriteByte('\n')
		}
	}
	walk(doc)
	return title, collapse(b.String())
}

// nodeText concatenates the text below n.
func nodeText(n *html.Node) string {
	var b strings.Builder
	var walk func(*html.Node)
	walk = func(n *html.Node) {
		if n.Type == html.TextNode {
			b.WriteString(n.Data)
		}
		for c := n.FirstChild; c != nil; c = c.NextSibling {
			walk(c)
		}
	}
	walk(n)
	return b.String()
}

// squashSpace turns every run of whitespace into a single space.
func squashSpace(s string) string {
	var b strings.Builder
	space := false
	for _, r := range s {
		if unicode.IsSpace(r) {
			space = true
			continue
		}
		if space {
			b.WriteByte(' ')
			space = false
		}
		b.WriteRune(r)
	}
	if space {
		b.WriteByte(' ')
	}
	return b.String()
}

// collapse squeezes runs of spaces and tabs into one space per line and
// drops empty lines.
func collapse(s string) string {
	lines := strings.Split(s, "\n")
	out := lines[:0]
	for _, l := range lines {
		if l = strings.Join(strings.Fields(l), " "); l != "" {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
