// A safe Markdown subset for an agent's answer (result.text): headings,
// paragraphs, lists, emphasis, code, and http(s) links. The text is never
// parsed as HTML: every piece becomes a text node or an element built here
// with createElement, so "<script>" is shown as the characters it is and a
// javascript: link stays text. Anything outside the subset is kept as
// plain text.

// Headings start below the page's own (the answer sits under an h3).
const HEADING_BASE = 3;
// Inline markup nests at most this deep; deeper markers stay text.
const MAX_DEPTH = 6;
const FENCE = /^\s{0,3}(```|~~~)/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const BULLET = /^\s{0,3}[-*+]\s+(.*)$/;
const NUMBERED = /^\s{0,3}(\d{1,9})[.)]\s+(.*)$/;
// One inline token: `code`, **strong** or __strong__, *em* or _em_ (an
// underscore only between non-word characters, so snake_case stays), or a
// [link](url). Each part stops at its own closing marker and a link's text
// and address are bounded, so a scan stays linear in the text's length.
const INLINE =
  /`([^`\n]{1,1000})`|\*\*((?:[^*\n]|\*(?!\*)){1,1000}?)\*\*|__([^_\n]{1,1000}?)__|\*([^*\s](?:[^*\n]{0,1000}?[^*\s])?)\*|(^|[^\p{L}\p{N}_])_([^_\s](?:[^_\n]{0,1000}?[^_\s])?)_(?![\p{L}\p{N}_])|\[([^\]\n]{1,200})\]\(([^()\s]{1,2000})\)/u;

/** safeHref returns the URL of an http(s) link, or null for anything else. */
export function safeHref(url) {
  if (!/^https?:\/\//i.test(url)) return null;
  try {
    const u = new URL(url);
    return u.protocol === 'http:' || u.protocol === 'https:' ? u.href : null;
  } catch {
    return null;
  }
}

/** renderMarkdown returns a DocumentFragment of text in the subset. */
export function renderMarkdown(text, doc = document) {
  const out = doc.createDocumentFragment();
  const lines = String(text).replace(/\r\n?/g, '\n').split('\n');
  let para = null; // lines of the open paragraph
  let list = null; // the open list element
  const closePara = () => {
    if (para) out.append(el(doc, 'p', inline(doc, para.join(' '), 0, true)));
    para = null;
  };
  const closeBlocks = () => {
    closePara();
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      closeBlocks();
      const body = [];
      for (i++; i < lines.length && !lines[i].trimStart().startsWith(fence[1]); i++) body.push(lines[i]);
      out.append(el(doc, 'pre', [el(doc, 'code', [doc.createTextNode(body.join('\n'))])]));
      continue;
    }
    if (line.trim() === '') {
      closeBlocks();
      continue;
    }
    const h = HEADING.exec(line);
    if (h) {
      closeBlocks();
      out.append(el(doc, 'h' + Math.min(h[1].length + HEADING_BASE, 6), inline(doc, h[2], 0, true)));
      continue;
    }
    const item = BULLET.exec(line) || NUMBERED.exec(line);
    if (item) {
      closePara();
      const tag = item.length === 3 ? 'ol' : 'ul';
      if (!list || list.tagName.toLowerCase() !== tag) {
        list = el(doc, tag, []);
        if (tag === 'ol' && item[1] !== '1') list.setAttribute('start', String(Number(item[1])));
        out.append(list);
      }
      list.append(el(doc, 'li', inline(doc, item[item.length - 1], 0, true)));
      continue;
    }
    if (list && /^\s/.test(line)) {
      // An indented line continues the last item.
      list.lastChild.append(' ', ...inline(doc, line.trim(), 0, true));
      continue;
    }
    list = null;
    (para = para || []).push(line.trim());
  }
  closePara();
  return out;
}

// inline turns one block's text into nodes; links only where allowed (a
// link's own text holds none).
function inline(doc, s, depth, links) {
  const nodes = [];
  while (s !== '') {
    const m = depth < MAX_DEPTH ? INLINE.exec(s) : null;
    if (!m) {
      nodes.push(doc.createTextNode(s));
      break;
    }
    let start = m.index;
    if (m[5]) start += m[5].length; // the character before an _em_
    if (start > 0) nodes.push(doc.createTextNode(s.slice(0, start)));
    nodes.push(token(doc, m, depth, links));
    s = s.slice(m.index + m[0].length);
  }
  return nodes;
}

// token builds the element of one inline match.
function token(doc, m, depth, links) {
  if (m[1] !== undefined) return el(doc, 'code', [doc.createTextNode(m[1])]);
  if (m[2] !== undefined || m[3] !== undefined) return el(doc, 'strong', inline(doc, m[2] ?? m[3], depth + 1, links));
  if (m[4] !== undefined || m[6] !== undefined) return el(doc, 'em', inline(doc, m[4] ?? m[6], depth + 1, links));
  const href = links ? safeHref(m[8]) : null;
  if (!href) {
    // Not an http(s) link (javascript:, data:, a relative path): its
    // source stays visible as text.
    return doc.createTextNode(m[0]);
  }
  const a = el(doc, 'a', inline(doc, m[7], depth + 1, false));
  a.setAttribute('href', href);
  a.setAttribute('rel', 'nofollow noopener');
  return a;
}

function el(doc, tag, children) {
  const node = doc.createElement(tag);
  node.append(...children);
  return node;
}
