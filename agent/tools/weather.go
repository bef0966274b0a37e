package tools

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"faregate/agent/chat"
	"faregate/agent/guide"
	"faregate/protect/codes"
)

// maxAPIBody bounds what the tool reads from a JSON API, whatever client
// it was given; a 7-day forecast is a few kilobytes.
const maxAPIBody = 1 << 20

const maxLocationLen = 100

// ErrUpstream reports a data source that answered, but not usefully.
var ErrUpstream = errors.New("tools: upstream answered badly")

// weather fetches forecasts; cfg has its defaults filled in.
type weather struct {
	c   *http.Client
	cfg Config
}

// NewWeather returns the weather tool: a 7-day forecast from an
// Open-Meteo-compatible API, located through the guide or, for other
// places, an Open-Meteo-compatible geocoding API. When the forecast cannot
// be had it answers with the guide's seasonal norms and the warning
// codes.WeatherUnavailable.
func NewWeather(c *http.Client, cfg Config) Tool {
	return weather{c: c, cfg: cfg.withDefaults()}
}

// Name implements Tool.
func (weather) Name() string { return NameWeather }

// Definition implements Tool.
func (weather) Definition() chat.ToolDef {
	return definition(NameWeather,
		"Get the daily weather forecast (next 7 days: high/low °C, chance of rain, conditions) for a city. "+
			"If the live forecast is down it returns the seasonal norms for the current month instead.",
		"location", "a city name, optionally with its country, e.g. \"Lisbon\" or \"Porto, Portugal\"")
}

// Forecast is the weather tool's answer as data.
type Forecast struct {
	// Place is the place the answer is for, as the model is told it
	// ("Lisbon, Portugal").
	Place string
	// Days is the live daily forecast, first day first; empty when it was
	// unavailable.
	Days []ForecastDay
	// Norm is the seasonal norm given instead of an unavailable forecast,
	// when the guide knows the place; nil otherwise.
	Norm *SeasonalNorm
}

// ForecastDay is one day of a forecast.
type ForecastDay struct {
	// Date is the day as the API sent it, YYYY-MM-DD.
	Date        string
	HighC, LowC float64
	// RainChance is the highest chance of rain in percent; nil when unknown.
	RainChance *float64
	// Code is the WMO weather interpretation code; nil when unknown.
	Code *int
}

// Label is the day as people write it ("Sat 15 Aug"), or Date as sent
// when it is not a date.
func (d ForecastDay) Label() string {
	if t, err := time.Parse(time.DateOnly, d.Date); err == nil {
		return t.Format("Mon 2 Jan")
	}
	return d.Date
}

// Condition describes Code in English ("light rain"), "" when unknown.
func (d ForecastDay) Condition() string {
	if d.Code == nil {
		return ""
	}
	return wmoCode(*d.Code)
}

// String is the day's forecast line as the model reads it.
func (d ForecastDay) String() string {
	line := fmt.Sprintf("%s: high %.0f °C, low %.0f °C", d.Label(), d.HighC, d.LowC)
	if d.RainChance != nil {
		line += fmt.Sprintf(", rain chance %.0f%%", *d.RainChance)
	}
	if c := d.Condition(); c != "" {
		line += ", " + c
	}
	return line
}

// SeasonalNorm is a city's climate norm for the month at the destination.
type SeasonalNorm struct {
	City  string
	Month int // 1–12
	guide.Norm
}

// String is the norm as the model reads it.
func (n SeasonalNorm) String() string {
	return fmt.Sprintf("Live forecast unavailable; seasonal norms for %s in %s: high %.0f °C, low %.0f °C, usually %s.",
		n.City, guide.MonthName(n.Month), n.HighC, n.LowC, n.Condition)
}

// place is a resolved location.
type place struct {
	label    string
	lat, lon float64
	city     *guide.City // set when the guide knows it: norms available
}

// Call implements Tool. A place that does not exist is the model's
// mistake (Failed, no warning); a service that does not answer is an
// outage (norms plus codes.WeatherUnavailable), so the operator can tell
// them apart.
func (w weather) Call(ctx context.Context, args string) Observation {
	loc, ok := stringArg(args, "location", maxLocationLen)
	if !ok {
		return badArgs(NameWeather, "location", `{"location": "Lisbon"}`, maxLocationLen)
	}
	p, found, err := w.locate(ctx, loc)
	switch {
	case err != nil:
		return w.unavailable(place{label: loc})
	case !found:
		return Observation{Failed: true, Text: fmt.Sprintf(
			"No place called %q was found. Give a city name, for example one of: %s.",
			loc, strings.Join(w.cfg.Guide.Cities(), ", "))}
	}
	days, err := w.forecast(ctx, p)
	if err != nil {
		return w.unavailable(p)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "Forecast for %s (%.2f, %.2f), next %d days:\n", p.label, p.lat, p.lon, len(days))
	for _, d := range days {
		b.WriteString(d.String() + "\n")
	}
	return Observation{Text: strings.TrimRight(b.String(), "\n"), Data: Forecast{Place: p.label, Days: days}}
}

// unavailable degrades to seasonal norms when the guide knows the place.
func (w weather) unavailable(p place) Observation {
	o := Observation{Failed: true, Warning: codes.WeatherUnavailable}
	if p.city == nil {
		o.Text = fmt.Sprintf("Live forecast unavailable for %s, and the guide has no seasonal norms for it.", p.label)
		o.Data = Forecast{Place: p.label}
		return o
	}
	// The month is the destination's, not the server's: on 31 January in
	// UTC it is already February in Tokyo.
	m := int(w.cfg.Now().Month())
	if loc, err := time.LoadLocation(p.city.Timezone); err == nil {
		m = int(w.cfg.Now().In(loc).Month())
	}
	n, _ := p.city.Norm(m)
	norm := SeasonalNorm{City: p.city.Name, Month: m, Norm: n}
	o.Text = norm.String()
	o.Degraded = true
	o.Data = Forecast{Place: p.label, Norm: &norm}
	return o
}

// locate resolves loc through the guide first (no request at all), then
// through the geocoding API. found=false with a nil error means the API
// answered and knows no such place.
func (w weather) locate(ctx context.Context, loc string) (place, bool, error) {
	if c, ok := w.cfg.Guide.Lookup(loc); ok {
		return place{label: c.Name + ", " + c.Country, lat: c.Lat, lon: c.Lon, city: &c}, true, nil
	}
	// Open-Meteo matches place names only: "Porto, Portugal" finds nothing,
	// "Porto" finds the city.
	name := loc
	if i := strings.IndexAny(name, ",("); i > 0 {
		name = strings.TrimSpace(name[:i])
	}
	q := url.Values{"name": {name}, "count": {"1"}, "language": {"en"}, "format": {"json"}}
	var geo struct {
		Results []struct {
			Name      string  `json:"name"`
			Country   string  `json:"country"`
			Admin1    string  `json:"admin1"`
			Latitude  float64 `json:"latitude"`
			Longitude float64 `json:"longitude"`
		} `json:"results"`
	}
	if err := getJSON(ctx, w.c, w.cfg.GeocodingURL, q, &geo); err != nil {
		return place{}, false, err
	}
	if len(geo.Results) == 0 {
		return place{}, false, nil
	}
	// count=1: the API ranks by population, so the first match is the city
	// a traveller most likely means.
	r := geo.Results[0]
	label := r.Name
	for _, part := range []string{r.Admin1, r.Country} {
		if part != "" && part != r.Name {
			label += ", " + part
		}
	}
	return place{label: label, lat: r.Latitude, lon: r.Longitude}, true, nil
}

// forecast fetches the daily forecast. The query is built from sorted
// parameters, so the same place always yields the same URL and the session
// cache can answer repeated calls.
func (w weather) forecast(ctx context.Context, p place) ([]ForecastDay, error) {
	q := url.Values{
		"latitude":      {strconv.FormatFloat(p.lat, 'f', 4, 64)},
		"longitude":     {strconv.FormatFloat(p.lon, 'f', 4, 64)},
		"daily":         {"temperature_2m_max,temperature_2m_min,precipitation_probability_max,weather_code"},
		"timezone":      {"auto"},
		"forecast_days": {"7"},
	}
	var fc struct {
		Daily struct {
			Time   []string   `json:"time"`
			Max    []*float64 `json:"temperature_2m_max"`
			Min    []*float64 `json:"temperature_2m_min"`
			Precip []*float64 `json:"precipitation_probability_max"`
			Code   []*float64 `json:"weather_code"`
		} `json:"daily"`
	}
	if err := getJSON(ctx, w.c, w.cfg.WeatherURL, q, &fc); err != nil {
		return nil, err
	}
	d := fc.Daily
	var days []ForecastDay
	for i, day := range d.Time {
		// Open-Meteo sends null for values it lacks; a day without both
		// temperatures is left out rather than shown as 0 °C.
		hi, lo := at(d.Max, i), at(d.Min, i)
		if hi == nil || lo == nil {
			continue
		}
		fd := ForecastDay{Date: day, HighC: *hi, LowC: *lo, RainChance: at(d.Precip, i)}
		if c := at(d.Code, i); c != nil {
			code := int(*c)
			fd.Code = &code
		}
		days = append(days, fd)
	}
	if len(days) == 0 {
		return nil, fmt.Errorf("%w: forecast without daily temperatures", ErrUpstream)
	}
	return days, nil
}

// at returns xs[i], or nil when the array is shorter than the time axis.
func at(xs []*float64, i int) *float64 {
	if i < len(xs) {
		return xs[i]
	}
	return nil
}

// getJSON GETs base with q added to its query and decodes a 2xx JSON answer.
func getJSON(ctx context.Context, c *http.Client, base string, q url.Values, into any) error {
	u, err := url.Parse(base)
	if err != nil {
		return fmt.Errorf("%w: bad endpoint: %w", ErrUpstream, err)
	}
	// The configured URL may carry its own parameters (an API key, a
	// language); the tool's parameters are added to them, not replace them.
	merged := u.Query()
	for k, vs := range q {
		merged[k] = vs
	}
	u.RawQuery = merged.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrUpstream, err)
	}
	req.Header.Set("Accept", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("%w: %s answered %d", ErrUpstream, u.Host, resp.StatusCode)
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, maxAPIBody)).Decode(into); err != nil {
		return fmt.Errorf("%w: %s: %w", ErrUpstream, u.Host, err)
	}
	return nil
}

// wmoCode describes a WMO weather interpretation code as Open-Meteo uses them.
func wmoCode(c int) string {
	switch c {
	case 0:
		return "clear sky"
	case 1:
		return "mainly clear"
	case 2:
		return "partly cloudy"
	case 3:
		return "overcast"
	case 45, 48:
		return "fog"
	case 51, 53, 55:
		return "drizzle"
	case 56, 57:
		return "freezing drizzle"
	case 61:
		return "light rain"
	case 63:
		return "rain"
	case 65:
		return "heavy rain"
	case 66, 67:
		return "freezing rain"
	case 71, 73, 75, 77:
		return "snow"
	case 80, 81:
		return "rain showers"
	case 82:
		return "violent rain showers"
	case 85, 86:
		return "snow showers"
	case 95:
		return "thunderstorm"
	case 96, 99:
		return "thunderstorm with hail"
	}
	return ""
}
