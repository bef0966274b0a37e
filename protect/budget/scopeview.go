package budget

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"
)

// ScopeView is one scope as an operator reads it (`faregate usage -site`,
// `-principal`, `-task`): its tokens and its money from the counters,
// whatever the key layout. Money is counted for the site (its spend
// scope), and for a principal and a task from layout 2 on.
type ScopeView struct {
	// Scope is "site", "principal" or "task"; Name the principal's or
	// task's id ("" for the site); Day the UTC day of its counters.
	Scope, Name, Day string
	// Tokens and Money (micro-units) of the scope; their Limit is not
	// shown (the counters do not know it).
	Tokens, Money ScopeUsage
	// Open counts the scope's open reservations (a principal's; the day's
	// direct ones for the site), Leases the day's live leases (site).
	Open, Leases int64
	// Layout is the day's key layout (1: every key under the day's tag;
	// 2: by principal, with leases).
	Layout int
}

// View is the scope of rep that view names (ScopeSite, ScopePrincipal or
// ScopeTask), as an operator reads it.
func View(rep UsageReport, scope Scope, name, day string) ScopeView {
	v := ScopeView{Scope: string(scope), Name: name, Day: day, Layout: rep.Layout}
	switch scope {
	case ScopePrincipal:
		v.Tokens, v.Money, v.Open = rep.Principal, rep.PrincipalSpend, rep.Reservations
	case ScopeTask:
		v.Tokens, v.Money = rep.Task, rep.TaskSpend
	default:
		v.Scope, v.Name = string(ScopeSite), ""
		v.Tokens, v.Money, v.Open, v.Leases = rep.Site, rep.Spend, rep.Reservations, rep.Leases
	}
	return v
}

// row is one unit's numbers as text: tokens as integers, money in
// currency units with six decimals.
func (v ScopeView) rows() [][]string {
	i := func(n int64) string { return strconv.FormatInt(n, 10) }
	t, m := v.Tokens, v.Money
	return [][]string{
		{"tokens", i(t.Settled), i(t.Outstanding), i(t.Leased), i(t.Overage)},
		{"money", FormatMicro(m.Settled), FormatMicro(m.Outstanding), FormatMicro(m.Leased), FormatMicro(m.Overage)},
	}
}

func (v ScopeView) title() string {
	if v.Name == "" {
		return v.Scope + " " + v.Day
	}
	return v.Scope + " " + v.Name + " " + v.Day
}

// WriteScopeTable prints v as an aligned table: one row for tokens, one
// for money, and what is open or leased.
func WriteScopeTable(w io.Writer, v ScopeView) error {
	if _, err := fmt.Fprintln(w, v.title()); err != nil {
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "UNIT\tSETTLED\tOUTSTANDING\tLEASED\tOVERAGE\n")
	for _, r := range v.rows() {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", r[0], r[1], r[2], r[3], r[4])
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "open reservations %d, live leases %d, key layout %d\n", v.Open, v.Leases, v.Layout)
	return err
}

// WriteScopeCSV writes v as CSV, a header and one row per unit.
func WriteScopeCSV(w io.Writer, v ScopeView) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"day", "scope", "name", "unit", "settled", "outstanding", "leased", "overage"})
	for _, r := range v.rows() {
		_ = cw.Write(append([]string{v.Day, v.Scope, v.Name}, r...))
	}
	cw.Flush()
	return cw.Error()
}

// scopeJSON is ScopeView's JSON form; money in micro-units.
type scopeJSON struct {
	Scope  string     `json:"scope"`
	Name   string     `json:"name,omitempty"`
	Day    string     `json:"day"`
	Tokens amountJSON `json:"tokens"`
	Money  amountJSON `json:"money_micro"`
	Open   int64      `json:"open_reservations"`
	Leases int64      `json:"live_leases"`
	Layout int        `json:"layout"`
}

type amountJSON struct {
	Settled     int64 `json:"settled"`
	Outstanding int64 `json:"outstanding"`
	Leased      int64 `json:"leased"`
	Overage     int64 `json:"overage"`
}

func amountOf(u ScopeUsage) amountJSON {
	return amountJSON{Settled: u.Settled, Outstanding: u.Outstanding, Leased: u.Leased, Overage: u.Overage}
}

// WriteScopeJSON writes v as one JSON object (money in micro-units).
func WriteScopeJSON(w io.Writer, v ScopeView) error {
	return json.NewEncoder(w).Encode(scopeJSON{Scope: v.Scope, Name: v.Name, Day: v.Day, Tokens: amountOf(v.Tokens),
		Money: amountOf(v.Money), Open: v.Open, Leases: v.Leases, Layout: v.Layout})
}
