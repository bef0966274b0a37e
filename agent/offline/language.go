package offline

import (
	"fmt"
	"time"

	"faregate/agent/task"
	"faregate/agent/tools"
)

// writer words a plan in one language. Entries are the guide's, in
// English; a writer either quotes them or names them (the part before the
// colon, a proper name kept as the guide spells it).
type writer interface {
	// prepare drops entries the language cannot use.
	prepare(n notes) notes
	around(city string) string
	bearings(city string) string
	morning(entry string) string
	lunch(entry string) string
	// afternoon visits entry; interest is the one it matched, or "".
	afternoon(entry, interest string) string
	freeAfternoon(interest, city string) string
	evening(entry string) string
	forecastDay(d tools.ForecastDay) string
	norm(n tools.SeasonalNorm) string
	summary(days int, city string, weather, noEntries bool, tip string) string
}

func writerFor(lang string) writer {
	if lang == task.LangChinese {
		return chinese{}
	}
	return english{}
}

// english quotes the guide's entries.
type english struct{}

func (english) prepare(n notes) notes       { return n }
func (english) around(city string) string   { return "Around " + city }
func (english) lunch(entry string) string   { return "Lunch: " + clip(entry, 200) }
func (english) evening(entry string) string { return "Evening: " + clip(entry, 200) }
func (english) morning(entry string) string { return "Morning: " + clip(entry, 220) }

func (english) bearings(city string) string {
	return fmt.Sprintf("Morning: walk the centre of %s and get your bearings", city)
}

func (english) afternoon(entry, interest string) string {
	line := "Afternoon: " + clip(entry, 200)
	if interest != "" {
		line += " (for your interest in " + interest + ")"
	}
	return line
}

func (english) freeAfternoon(interest, city string) string {
	return fmt.Sprintf("Afternoon: time for %s in %s", interest, city)
}

func (english) forecastDay(d tools.ForecastDay) string { return "Weather: " + clip(d.String(), 160) }
func (english) norm(n tools.SeasonalNorm) string       { return "Weather: " + clip(n.String(), 160) }

func (english) summary(days int, city string, weather, noEntries bool, tip string) string {
	s := fmt.Sprintf("A %d-day plan for %s from the offline demo planner (deterministic rules, not an LLM), built from the travel guide", days, city)
	if weather {
		s += " and the weather tool's answer"
	}
	s += "."
	if noEntries {
		s += " The built-in guide has no entry for this destination, so the days are general suggestions."
	}
	if tip != "" {
		s += " Tip: " + clip(tip, 200)
	}
	return s
}

// chinese names places and dishes as the guide spells them and writes
// everything around them in Chinese; the guide's English descriptions are
// left out.
type chinese struct{}

// prepare keeps the entries that have a name; practical notes are prose
// with nothing to name, so they go.
func (chinese) prepare(n notes) notes {
	keep := func(list []string) []string {
		var out []string
		for _, e := range list {
			if _, ok := named(e); ok {
				out = append(out, e)
			}
		}
		return out
	}
	return notes{city: n.city, neighbourhoods: keep(n.neighbourhoods), food: keep(n.food), sights: keep(n.sights)}
}

func (chinese) around(city string) string { return city + " 周边" }
func (chinese) bearings(city string) string {
	return "上午：在 " + city + " 市中心散步，熟悉环境"
}
func (chinese) morning(entry string) string { return "上午：参观 " + entryName(entry) }
func (chinese) lunch(entry string) string   { return "午餐：品尝 " + entryName(entry) }
func (chinese) evening(entry string) string {
	return "晚上：在 " + entryName(entry) + " 一带漫步"
}

func (chinese) afternoon(entry, interest string) string {
	line := "下午：游览 " + entryName(entry)
	if interest != "" {
		line += "（契合你对「" + interest + "」的兴趣）"
	}
	return line
}

func (chinese) freeAfternoon(interest, city string) string {
	return "下午：在 " + city + " 安排与「" + interest + "」相关的活动"
}

// zhWeekdays are the weekday names, Sunday first as time.Weekday counts.
var zhWeekdays = [7]string{"周日", "周一", "周二", "周三", "周四", "周五", "周六"}

func (chinese) forecastDay(d tools.ForecastDay) string {
	label := d.Date
	if t, err := time.Parse(time.DateOnly, d.Date); err == nil {
		label = fmt.Sprintf("%d月%d日（%s）", t.Month(), t.Day(), zhWeekdays[t.Weekday()])
	}
	line := fmt.Sprintf("天气：%s 最高 %.0f°C，最低 %.0f°C", label, d.HighC, d.LowC)
	if d.RainChance != nil {
		line += fmt.Sprintf("，降水概率 %.0f%%", *d.RainChance)
	}
	if d.Code != nil {
		if c, ok := zhWMO[*d.Code]; ok {
			line += "，" + c
		}
	}
	return line
}

func (chinese) norm(n tools.SeasonalNorm) string {
	cond := zhConditions[n.Condition]
	if cond == "" {
		cond = n.Condition
	}
	return fmt.Sprintf("天气：实时预报不可用；%s %d月的季节常态：最高 %.0f°C，最低 %.0f°C，通常%s。",
		n.City, n.Month, n.HighC, n.LowC, cond)
}

func (chinese) summary(days int, city string, weather, noEntries bool, _ string) string {
	from := "内置旅行指南"
	if weather {
		from += "和天气工具的结果"
	}
	s := fmt.Sprintf("离线演示规划器（确定性规则，不是大语言模型）根据%s为 %s 制定的 %d 日行程。", from, city, days)
	if noEntries {
		s += "内置指南没有这个目的地的条目，因此每天的安排只是一般性建议。"
	}
	return s
}

// zhWMO describes WMO weather codes as Open-Meteo uses them.
var zhWMO = map[int]string{
	0: "晴", 1: "大致晴朗", 2: "局部多云", 3: "阴",
	45: "雾", 48: "雾",
	51: "毛毛雨", 53: "毛毛雨", 55: "毛毛雨", 56: "冻毛毛雨", 57: "冻毛毛雨",
	61: "小雨", 63: "中雨", 65: "大雨", 66: "冻雨", 67: "冻雨",
	71: "降雪", 73: "降雪", 75: "降雪", 77: "降雪",
	80: "阵雨", 81: "阵雨", 82: "强阵雨", 85: "阵雪", 86: "阵雪",
	95: "雷暴", 96: "雷暴伴有冰雹", 99: "雷暴伴有冰雹",
}

// zhConditions translates the guide's one-word climate conditions.
var zhConditions = map[string]string{
	"sunny": "晴朗", "rainy": "多雨", "showery": "多阵雨", "mixed": "晴雨不定", "cloudy": "多云",
	"humid": "潮湿", "hot": "炎热", "cold": "寒冷", "windy": "多风",
}
