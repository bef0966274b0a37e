package main

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"reflect"
	"slices"
	"strings"
	"time"
)

// rule is one row of the configuration's checks (configRules): the
// variable it is about, without the FAREGATE_ prefix, and its check. A
// check may read other variables; it names them in reads, so that a rule
// whose variables did not parse is skipped (the parse error is reported
// instead) while every other rule still runs: all problems at once.
type rule struct {
	name  string
	check check
	reads []string
}

// check returns what is wrong with the variable's value v (the struct
// field), or "". Bound checks look only at v; cross checks read c. A
// check may store what it parsed in c's derived fields.
type check func(c *config, v reflect.Value) string

// number is what the bound checks compare: every numeric field type of
// config (time.Duration is an int64).
type number interface {
	~int | ~int64 | ~uint32 | ~float64
}

// valueOf is v as a T; ok is false when the rule's bound has another type
// than the field, a mistake in the table that TestConfigRulesTyped finds.
func valueOf[T number](v reflect.Value) (T, bool) {
	x, ok := v.Interface().(T)
	return x, ok
}

func typeMismatch[T number](v reflect.Value) string {
	var zero T
	return fmt.Sprintf("internal: the rule's bound is a %T but the variable is a %s", zero, v.Type())
}

// atLeast: lo or more.
func atLeast[T number](lo T) check {
	return func(_ *config, v reflect.Value) string {
		x, ok := valueOf[T](v)
		switch {
		case !ok:
			return typeMismatch[T](v)
		case x < lo:
			return "want at least " + show(lo)
		}
		return ""
	}
}

// between: lo to hi, both included.
func between[T number](lo, hi T) check {
	return func(_ *config, v reflect.Value) string {
		x, ok := valueOf[T](v)
		switch {
		case !ok:
			return typeMismatch[T](v)
		case x < lo || x > hi:
			return "want " + show(lo) + " to " + show(hi)
		}
		return ""
	}
}

// positive: a duration above 0.
func positive() check {
	return func(_ *config, v reflect.Value) string {
		x, ok := valueOf[time.Duration](v)
		switch {
		case !ok:
			return typeMismatch[time.Duration](v)
		case x <= 0:
			return "want a positive duration"
		}
		return ""
	}
}

// noted adds note to what c finds wrong: what a special value means.
func noted(c check, note string) check {
	return func(cfg *config, v reflect.Value) string {
		if msg := c(cfg, v); msg != "" {
			return msg + " (" + note + ")"
		}
		return ""
	}
}

// ratio: a share in (0, 1].
func ratio() check {
	return func(_ *config, v reflect.Value) string {
		x, ok := valueOf[float64](v)
		switch {
		case !ok:
			return typeMismatch[float64](v)
		case x <= 0 || x > 1:
			return "want a ratio in (0, 1]"
		}
		return ""
	}
}

// atMostVar: no more than the variable other (a number of the same type).
func atMostVar[T number](other string) check {
	return func(c *config, v reflect.Value) string {
		x, ok := valueOf[T](v)
		y, ok2 := valueOf[T](c.field(other))
		switch {
		case !ok || !ok2:
			return typeMismatch[T](v)
		case x > y:
			return fmt.Sprintf("want at most FAREGATE_%s (%s)", other, show(y))
		}
		return ""
	}
}

// oneOf: one of the words.
func oneOf(words ...string) check {
	return func(_ *config, v reflect.Value) string {
		if s := v.String(); !slices.Contains(words, s) {
			return fmt.Sprintf("%q: want %s", s, orList(words))
		}
		return ""
	}
}

// httpURL: empty, or an absolute http(s) URL.
func httpURL() check {
	return func(_ *config, v reflect.Value) string {
		s := v.String()
		if s == "" {
			return ""
		}
		if u, err := url.Parse(s); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Sprintf("%q: want an http(s) URL", s)
		}
		return ""
	}
}

// listenAddr: host:port with a port net.Listen accepts (a number from 0
// to 65535, or a service name), so a bad port is refused at start rather
// than when listening; empty only when not required.
func listenAddr(required bool) check {
	return func(_ *config, v reflect.Value) string {
		s := v.String()
		if s == "" && !required {
			return ""
		}
		_, port, err := net.SplitHostPort(s)
		if err != nil {
			return fmt.Sprintf("%q: want host:port", s)
		}
		if _, err := net.LookupPort("tcp", port); err != nil {
			return fmt.Sprintf("%q: want host:port with a port number from 0 to 65535", s)
		}
		return ""
	}
}

// minLen: empty, or at least n characters (why says what to use).
func minLen(n int, why string) check {
	return func(_ *config, v reflect.Value) string {
		if s := v.String(); s != "" && len(s) < n {
			return fmt.Sprintf("use at least %d characters (%s)", n, why)
		}
		return ""
	}
}

// requiredWith: not empty when the variable other is set; why ends the
// sentence. The rule must list other in reads.
func requiredWith(other, why string) check {
	return func(c *config, v reflect.Value) string {
		if !empty(v) || empty(c.field(other)) {
			return ""
		}
		return fmt.Sprintf("required when FAREGATE_%s is set, %s", other, why)
	}
}

// empty reports an unset variable: a zero value, or a list with nothing
// in it.
func empty(v reflect.Value) bool {
	if v.Kind() == reflect.Slice {
		return v.Len() == 0
	}
	return v.IsZero()
}

// parsed runs parse (which stores what it derives in c) and reports its
// error; msg, when not empty, replaces the error's own text.
func parsed(msg string, parse func(c *config) error) check {
	return func(c *config, _ reflect.Value) string {
		err := parse(c)
		switch {
		case err == nil:
			return ""
		case msg != "":
			return msg
		}
		return err.Error()
	}
}

// custom is a check on c alone.
func custom(fn func(c *config) string) check {
	return func(c *config, _ reflect.Value) string { return fn(c) }
}

// show writes a bound as an operator writes it: 1m, not 1m0s.
func show(x any) string {
	if d, ok := x.(time.Duration); ok {
		s := d.String()
		if strings.HasSuffix(s, "m0s") {
			s = strings.TrimSuffix(s, "0s")
		}
		if strings.HasSuffix(s, "h0m") {
			s = strings.TrimSuffix(s, "0m")
		}
		return s
	}
	return fmt.Sprint(x)
}

func orList(words []string) string {
	if len(words) < 2 {
		return strings.Join(words, "")
	}
	return strings.Join(words[:len(words)-1], ", ") + " or " + words[len(words)-1]
}

// field is the struct field of variable name (without prefix); the zero
// Value for a name the struct does not have.
func (c *config) field(name string) reflect.Value {
	rv := reflect.ValueOf(c).Elem()
	rt := rv.Type()
	for i := range rt.NumField() {
		if rt.Field(i).Tag.Get("env") == name {
			return rv.Field(i)
		}
	}
	return reflect.Value{}
}

// runRules runs every rule of rules, skipping those that read a variable
// in unparsed, and returns each problem as "FAREGATE_<name>: <problem>",
// in table order.
func (c *config) runRules(rules []rule, unparsed map[string]bool) error {
	var errs []error
	for _, r := range rules {
		if unparsed[r.name] || slices.ContainsFunc(r.reads, func(n string) bool { return unparsed[n] }) {
			continue
		}
		v := c.field(r.name)
		if !v.IsValid() {
			errs = append(errs, fmt.Errorf("internal: a configuration rule names FAREGATE_%s, which config does not have", r.name))
			continue
		}
		if msg := r.check(c, v); msg != "" {
			errs = append(errs, fmt.Errorf("FAREGATE_%s: %s", r.name, msg))
		}
	}
	return errors.Join(errs...)
}
