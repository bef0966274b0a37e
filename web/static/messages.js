// Every sentence a visitor reads, in English and Simplified Chinese, plus
// the few formatters whose output depends on the language (waiting times,
// durations). Error codes, task failure codes and warning codes map to text
// only here, so a new server code needs nothing but table entries.
//
// The tables are written as strict JSON (double quotes, no trailing commas,
// no comments inside) because web_test.go parses them to prove that both
// languages have the same keys and that every server code has a message.
// Keep the "// end of tables" marker right after the closing brace.
export const TABLES = {
  "en": {
    "page.title": "Trip planner demo — faregate",
    "skip": "Skip to the form",
    "app.heading": "Plan a short trip",
    "app.tagline": "Try the travel planner: say where and for how long, then watch it work step by step. Every visitor gets a few free plans per day.",
    "lang.label": "Language",
    "lang.name.en": "English",
    "lang.name.zh-CN": "简体中文",
    "banner.dev": "Development mode: this server runs on embedded defaults (in-process storage and test settings). It is not set up for production use.",
    "banner.turnstile_test": "Development mode: the human check is simulated with Cloudflare's test token, so no Turnstile widget is loaded.",
    "banner.offline": "Plans come from the built-in deterministic demo planner, not from a language model.",
    "banner.model_degraded": "The planner's model is having trouble; plans may be slower or written by a backup model.",
    "banner.model_unavailable": "The planner's model is unavailable right now, so new plans will probably be refused. Please come back later.",
    "form.heading": "Your trip",
    "form.destination.label": "Destination",
    "form.destination.hint": "A city or region, 1 to {max} characters.",
    "form.days.label": "Number of days",
    "form.days.hint": "A whole number from {min} to {max}.",
    "form.interests.legend": "Interests (optional)",
    "form.interests.hint": "Pick up to {max}, or add your own (each up to {len} characters).",
    "form.interests.count": "{n} of {max} selected",
    "form.interests.custom.label": "Add your own interest",
    "form.interests.add": "Add",
    "interest.food": "Food",
    "interest.history": "History",
    "interest.art": "Art",
    "interest.nature": "Nature",
    "interest.architecture": "Architecture",
    "interest.museums": "Museums",
    "interest.nightlife": "Nightlife",
    "interest.shopping": "Shopping",
    "form.check.heading": "Human check",
    "form.check.test": "Skipped in development mode: the test token is sent instead.",
    "form.check.needed": "Complete the human check; the button turns on once it has passed.",
    "form.check.passed": "Check passed. You can send the form.",
    "form.submit": "Plan my trip",
    "form.submitting": "Sending…",
    "app.heading.prompt": "Ask the agent",
    "app.tagline.prompt": "Try the agent: write what you need, then watch it work step by step. Every visitor gets a few free tasks per day.",
    "form.heading.prompt": "Your request",
    "form.prompt.label": "What should the agent do?",
    "form.prompt.hint": "Plain text, 1 to {max} characters; line breaks are fine.",
    "form.submit.prompt": "Send to the agent",
    "field.prompt": "Enter a request of 1 to {max} characters.",
    "field.prompt_control": "Remove invisible characters (such as zero-width spaces) from your request; line breaks are fine.",
    "task.heading.prompt": "Your task",
    "task.result.heading.prompt": "Answer",
    "status.done.prompt": "Your answer is ready.",
    "field.destination": "Enter a destination of 1 to {max} characters.",
    "field.days": "Enter a whole number of days from {min} to {max}.",
    "field.interests": "Choose at most {max} interests, each 1 to {len} characters.",
    "field.interests_max": "You can choose at most {max} interests. Deselect one first.",
    "field.interest_length": "An interest must be 1 to {len} characters.",
    "field.control": "Remove invisible characters (such as zero-width spaces, tabs or line breaks) from this field.",
    "status.loading_config": "Loading…",
    "status.sending": "Sending your request…",
    "status.accepted": "Request accepted. Your plan is being prepared; progress appears below.",
    "status.loading_task": "Loading the saved plan…",
    "status.following": "Following the progress of this plan…",
    "status.polling": "Live updates are not available right now; checking for updates every few seconds.",
    "status.done": "Your plan is ready.",
    "ref": "Reference: {id}",
    "retry.in": "Try again in {rel}.",
    "retry.in_at": "Try again in {rel}, at {at} UTC.",
    "time.s": "{s} s",
    "time.min": "{m} min",
    "time.h": "{h} h",
    "time.h_min": "{h} h {m} min",
    "duration.ms": "{n} ms",
    "duration.s": "{n} s",
    "err.invalid_request": "Some of the trip details are not valid.",
    "err.invalid_request.next": "Correct the highlighted fields and send again.",
    "err.turnstile_failed": "The human check did not pass.",
    "err.turnstile_failed.next": "Complete the check again and resend. If it keeps failing, reload the page.",
    "err.task_not_found": "This plan could not be found.",
    "err.task_not_found.next": "The link may be mistyped or the plan has expired. Start a new plan with the form.",
    "err.request_too_large": "The request is too large.",
    "err.request_too_large.next": "Shorten the destination or the interests and send again.",
    "err.unsupported_media_type": "The browser sent the request in a format the server does not accept.",
    "err.unsupported_media_type.next": "Reload the page and try again.",
    "err.demo_ip_limit_reached": "You have used all your free plans for today.",
    "err.demo_ip_limit_reached.next": "Your allowance renews at midnight UTC.",
    "err.demo_global_limit_reached": "The demo has reached its limit of plans for today.",
    "err.demo_global_limit_reached.next": "Everyone's allowance renews at midnight UTC.",
    "err.demo_budget_exhausted": "The demo has used up today's model budget.",
    "err.demo_budget_exhausted.next": "The budget renews at midnight UTC.",
    "err.internal_error": "Something went wrong on our side.",
    "err.internal_error.next": "Try again in a moment. If it keeps happening, quote the reference below.",
    "err.demo_protection_unavailable": "The abuse protection is briefly unavailable, so no new plan can start.",
    "err.demo_protection_unavailable.next": "Nothing was counted. Wait a few seconds and send again.",
    "err.model_unavailable": "The planner's model is not answering right now.",
    "err.model_unavailable.next": "Try again in a few minutes.",
    "err.aitf_queue_full": "Too many people are trying at once.",
    "err.aitf_queue_full.next": "Wait a few seconds and send again.",
    "err.prompt_rejected": "The trip details contain text the planner does not accept, such as instructions meant for the AI.",
    "err.prompt_rejected.next": "Describe only the destination and your interests, then send again.",
    "err.invalid_api_key": "The API key was not accepted.",
    "err.invalid_api_key.next": "Check the key, or use the page without one.",
    "err.not_found": "The page asked the server for something that does not exist.",
    "err.not_found.next": "Reload the page. If it keeps happening, quote the reference below.",
    "err.method_not_allowed": "The server did not accept the way the page asked.",
    "err.method_not_allowed.next": "Reload the page. If it keeps happening, quote the reference below.",
    "err.too_many_streams": "Too many plans are being followed live from your connection.",
    "err.too_many_streams.next": "Close other tabs that show plans in progress. This page checks for updates every few seconds instead.",
    "err.rate_limited": "Too many requests in a short time.",
    "err.rate_limited.next": "Wait a moment before you send again.",
    "err.too_many_failed_checks": "Too many attempts from your connection were refused in the last hour.",
    "err.too_many_failed_checks.next": "Wait until the time below, then fill in the form and complete the human check once more.",
    "err.server_busy": "The server is very busy right now.",
    "err.server_busy.next": "Nothing was counted. Wait a few seconds and send again.",
    "err.model_not_allowed": "The agent asked for a model it may not use.",
    "err.model_not_allowed.next": "Use a listed model.",
    "err.unsupported_parameter": "The agent used a parameter this demo refuses.",
    "err.unsupported_parameter.next": "Leave it out.",
    "err.step_limit": "The task has no model calls left.",
    "err.step_limit.next": "Start a new task.",
    "err.too_many_calls": "Too many model calls at once.",
    "err.too_many_calls.next": "Wait for one to finish.",
    "err.input_spike": "A prompt far larger than usual ended the task.",
    "err.input_spike.next": "Try a shorter request.",
    "err.fetch_refused": "The agent asked for a page that is not on the public internet.",
    "err.fetch_refused.next": "Nothing was fetched. Use a public http or https address.",
    "err.task_finished": "This task has already finished.",
    "err.task_finished.next": "Its result was taken; nothing more can be sent for it.",
    "err.event_limit": "This task has sent all the progress updates it may.",
    "err.event_limit.next": "Further updates are not shown; the task goes on.",
    "err.tool_limit": "This task has made all the page fetches it may.",
    "err.tool_limit.next": "Finish the answer with what was already fetched.",
    "err.anomaly_blocked": "Unusual requests from your connection were paused for a while.",
    "err.anomaly_blocked.next": "Nothing was counted. You can send again after the time below.",
    "err.token_rate_limited": "The planner is doing as much work as it can this minute.",
    "err.token_rate_limited.next": "Nothing was counted. Send again after the time below.",
    "err.key_daily_limit_reached": "This API key has used all its plans for today.",
    "err.key_daily_limit_reached.next": "Its allowance renews at midnight UTC.",
    "err.network": "The server could not be reached.",
    "err.network.next": "Check your internet connection and try again.",
    "err.unknown": "Something unexpected went wrong.",
    "err.unknown.next": "Try again in a moment, or reload the page.",
    "err.config": "The page could not load its settings.",
    "err.config.next": "Reload the page in a moment.",
    "err.turnstile_load": "The human check could not load.",
    "err.turnstile_load.next": "Allow challenges.cloudflare.com in your content blocker or try another network, then reload the page.",
    "err.turnstile_widget": "The human check ran into a problem.",
    "err.turnstile_widget.next": "Wait for it to retry, or reload the page.",
    "taskerr.model_unavailable": "The planner's model stopped answering while it worked on your plan.",
    "taskerr.model_unavailable.next": "This attempt still counts toward today's plans. Try again in a few minutes.",
    "taskerr.agent_failed": "The agent could not finish this task.",
    "taskerr.agent_failed.next": "Try again, perhaps with a simpler request. This attempt still counts toward today's tasks.",
    "taskerr.worker_lost": "The server that was preparing your plan stopped before it finished.",
    "taskerr.worker_lost.next": "Your plan was not run or charged twice, but this attempt still counts toward today's plans. Start a new one with the form.",
    "taskerr.input_spike": "The planner stopped because this request was far larger than usual, so the model was not asked.",
    "taskerr.input_spike.next": "This attempt still counts toward today's plans. Try a shorter request.",
    "taskerr.token_rate_limited": "The planner reached its limit of work per minute before your plan was finished.",
    "taskerr.token_rate_limited.next": "This attempt still counts toward today's plans. Wait a minute, then try again.",
    "taskerr.agent_unreachable": "The agent that answers this demo could not be reached.",
    "taskerr.agent_unreachable.next": "This attempt still counts toward today's tasks. Try again later.",
    "taskerr.agent_timeout": "The agent took the task but did not answer in time.",
    "taskerr.agent_timeout.next": "This attempt still counts toward today's tasks. Try again, perhaps with a simpler request.",
    "taskerr.unknown": "The planner could not finish this plan.",
    "taskerr.unknown.next": "This attempt still counts toward today's plans. Try again in a moment.",
    "task.heading": "Your plan",
    "task.heading_for": "Your plan for {destination}",
    "task.status.queued": "Status: waiting to start",
    "task.status.running": "Status: working",
    "task.status.succeeded": "Status: finished",
    "task.status.failed": "Status: failed",
    "task.status.unknown": "Status: unknown",
    "task.quota": "Plans left today: {ip} for you, {global} for the whole site.",
    "task.steps.heading": "Progress",
    "task.steps.empty": "Waiting for the first step…",
    "step.kind.model": "Model",
    "step.kind.tool": "Tool",
    "step.kind.agent": "Agent",
    "step.kind.unknown": "Step",
    "step.status.started": "running…",
    "step.status.ok": "done",
    "step.status.failed": "failed",
    "step.status.cached": "from cache",
    "step.status.degraded": "done with a fallback",
    "step.status.unknown": "unknown",
    "task.result.heading": "Itinerary",
    "task.day": "Day {n}",
    "task.day_prefix": "Day {n}: ",
    "task.warnings.heading": "Please note",
    "task.model": "Written by the model {model}.",
    "task.model_offline": "Written by {model}, the built-in demo planner (not a language model).",
    "task.usage": "Tokens used: {prompt} in, {completion} out.",
    "task.cached": "Served from a cached plan for the same request: no tokens were spent.",
    "warn.weather_unavailable": "Live weather was unavailable, so the plan uses seasonal norms.",
    "warn.search_unavailable": "The travel guide search was unavailable, so the plan relies on general knowledge.",
    "warn.fetch_failed": "Some pages could not be fetched, so a few details may be less specific.",
    "warn.downstream_pushback": "A data source asked us to slow down, so some live details were skipped.",
    "warn.budget_exhausted": "The token budget ran out, so the plan was finished early and may be shorter.",
    "warn.output_truncated": "The answer reached its length limit and was cut short.",
    "warn.output_loop": "The model started repeating itself, so the answer was stopped early.",
    "warn.step_limit": "The planner reached its step limit and finished with what it had.",
    "warn.tool_limit": "The planner reached its limit of lookups, so some details could not be checked.",
    "warn.time_limit": "The planner ran out of time and finished with what it had.",
    "warn.tool_loop": "The planner kept repeating the same lookup, so it was stopped and the plan finished without it.",
    "warn.low_precision": "Some details are approximate; check opening hours and prices before you go.",
    "warn.fallback_model": "The main model was unavailable, so a backup model wrote this plan.",
    "warn.unknown": "Something limited this plan, so some details may be incomplete."
  },
  "zh-CN": {
    "page.title": "旅行规划演示 — faregate",
    "skip": "跳到表单",
    "app.heading": "规划一次短途旅行",
    "app.tagline": "试用旅行规划助手：告诉它目的地和天数，然后一步步看它工作。每位访客每天有几次免费规划。",
    "lang.label": "语言",
    "lang.name.en": "English",
    "lang.name.zh-CN": "简体中文",
    "banner.dev": "开发模式：此服务器使用内置默认配置（进程内存储和测试设置），不适用于生产环境。",
    "banner.turnstile_test": "开发模式：人机验证使用 Cloudflare 的测试令牌模拟，因此不会加载 Turnstile 组件。",
    "banner.offline": "行程由内置的确定性演示规划器生成，而不是由语言模型生成。",
    "banner.model_degraded": "规划器的模型目前运行不稳定；生成可能较慢，或由备用模型完成。",
    "banner.model_unavailable": "规划器的模型目前不可用，新的规划很可能会被拒绝。请稍后再来。",
    "form.heading": "你的旅行",
    "form.destination.label": "目的地",
    "form.destination.hint": "城市或地区，1 到 {max} 个字符。",
    "form.days.label": "天数",
    "form.days.hint": "{min} 到 {max} 之间的整数。",
    "form.interests.legend": "兴趣（可选）",
    "form.interests.hint": "最多选择 {max} 项，也可以自行添加（每项最多 {len} 个字符）。",
    "form.interests.count": "已选择 {n} / {max} 项",
    "form.interests.custom.label": "添加自定义兴趣",
    "form.interests.add": "添加",
    "interest.food": "美食",
    "interest.history": "历史",
    "interest.art": "艺术",
    "interest.nature": "自然",
    "interest.architecture": "建筑",
    "interest.museums": "博物馆",
    "interest.nightlife": "夜生活",
    "interest.shopping": "购物",
    "form.check.heading": "人机验证",
    "form.check.test": "开发模式下已跳过：将改为发送测试令牌。",
    "form.check.needed": "请完成人机验证；通过后按钮即可使用。",
    "form.check.passed": "验证已通过，可以提交表单。",
    "form.submit": "规划我的旅行",
    "form.submitting": "正在发送…",
    "app.heading.prompt": "向代理提问",
    "app.tagline.prompt": "试用代理：写下你的需求，然后一步步看它工作。每位访客每天有几次免费任务。",
    "form.heading.prompt": "你的请求",
    "form.prompt.label": "你想让代理做什么？",
    "form.prompt.hint": "纯文本，1 到 {max} 个字符；可以换行。",
    "form.submit.prompt": "发送给代理",
    "field.prompt": "请输入 1 到 {max} 个字符的请求。",
    "field.prompt_control": "请删除请求中的不可见字符（如零宽空格）；换行没有问题。",
    "task.heading.prompt": "你的任务",
    "task.result.heading.prompt": "回答",
    "status.done.prompt": "你的回答已生成。",
    "field.destination": "请输入 1 到 {max} 个字符的目的地。",
    "field.days": "请输入 {min} 到 {max} 之间的整数天数。",
    "field.interests": "最多选择 {max} 项兴趣，每项 1 到 {len} 个字符。",
    "field.interests_max": "最多只能选择 {max} 项兴趣，请先取消一项。",
    "field.interest_length": "兴趣必须为 1 到 {len} 个字符。",
    "field.control": "请删除此字段中的不可见字符（如零宽空格、制表符或换行符）。",
    "status.loading_config": "正在加载…",
    "status.sending": "正在发送你的请求…",
    "status.accepted": "请求已受理，正在生成行程；进度显示在下方。",
    "status.loading_task": "正在加载已保存的行程…",
    "status.following": "正在跟踪此行程的进度…",
    "status.polling": "暂时无法实时更新；将每隔几秒检查一次进度。",
    "status.done": "你的行程已生成。",
    "ref": "参考编号：{id}",
    "retry.in": "请在 {rel}后重试。",
    "retry.in_at": "请在 {rel}后（UTC 时间 {at}）重试。",
    "time.s": "{s} 秒",
    "time.min": "{m} 分钟",
    "time.h": "{h} 小时",
    "time.h_min": "{h} 小时 {m} 分钟",
    "duration.ms": "{n} 毫秒",
    "duration.s": "{n} 秒",
    "err.invalid_request": "部分旅行信息无效。",
    "err.invalid_request.next": "请更正标出的字段后重新发送。",
    "err.turnstile_failed": "人机验证未通过。",
    "err.turnstile_failed.next": "请重新完成验证后再发送。如果一直失败，请刷新页面。",
    "err.task_not_found": "找不到这个行程。",
    "err.task_not_found.next": "链接可能有误，或行程已过期。请用表单开始新的规划。",
    "err.request_too_large": "请求内容过大。",
    "err.request_too_large.next": "请缩短目的地或兴趣后重新发送。",
    "err.unsupported_media_type": "浏览器发送的请求格式不被服务器接受。",
    "err.unsupported_media_type.next": "请刷新页面后重试。",
    "err.demo_ip_limit_reached": "你今天的免费规划次数已用完。",
    "err.demo_ip_limit_reached.next": "次数将在 UTC 午夜重置。",
    "err.demo_global_limit_reached": "本演示今天的规划总次数已达上限。",
    "err.demo_global_limit_reached.next": "所有人的次数将在 UTC 午夜重置。",
    "err.demo_budget_exhausted": "本演示今天的模型预算已用完。",
    "err.demo_budget_exhausted.next": "预算将在 UTC 午夜重置。",
    "err.internal_error": "服务器端出现了问题。",
    "err.internal_error.next": "请稍后重试。如果问题持续，请提供下方的参考编号。",
    "err.demo_protection_unavailable": "防滥用保护暂时不可用，因此无法开始新的规划。",
    "err.demo_protection_unavailable.next": "本次没有计入次数。请等几秒后重新发送。",
    "err.model_unavailable": "规划器的模型目前没有响应。",
    "err.model_unavailable.next": "请几分钟后再试。",
    "err.aitf_queue_full": "同时尝试的人太多了。",
    "err.aitf_queue_full.next": "请等几秒后重新发送。",
    "err.prompt_rejected": "旅行信息中包含规划器不接受的内容，例如写给 AI 的指令。",
    "err.prompt_rejected.next": "请只填写目的地和兴趣，然后重新发送。",
    "err.invalid_api_key": "API 密钥未被接受。",
    "err.invalid_api_key.next": "请检查密钥，或不使用密钥直接使用本页面。",
    "err.not_found": "页面向服务器请求了不存在的内容。",
    "err.not_found.next": "请刷新页面。如果问题持续，请提供下方的参考编号。",
    "err.method_not_allowed": "服务器不接受页面的请求方式。",
    "err.method_not_allowed.next": "请刷新页面。如果问题持续，请提供下方的参考编号。",
    "err.too_many_streams": "你的网络连接同时实时跟踪的行程过多。",
    "err.too_many_streams.next": "请关闭其他显示进行中行程的标签页。本页面将改为每隔几秒检查一次进度。",
    "err.rate_limited": "短时间内请求次数过多。",
    "err.rate_limited.next": "请稍等片刻再发送。",
    "err.too_many_failed_checks": "过去一小时内，来自你的网络连接的尝试被拒绝次数过多。",
    "err.too_many_failed_checks.next": "请等到下方所示时间后，重新填写表单并再次完成人机验证。",
    "err.server_busy": "服务器当前非常繁忙。",
    "err.server_busy.next": "本次没有计入次数。请等几秒后重新发送。",
    "err.model_not_allowed": "代理请求了它无权使用的模型。",
    "err.model_not_allowed.next": "请使用列出的模型。",
    "err.unsupported_parameter": "代理使用了本演示拒绝的参数。",
    "err.unsupported_parameter.next": "请去掉该参数。",
    "err.step_limit": "本任务的模型调用已用完。",
    "err.step_limit.next": "请新建任务。",
    "err.too_many_calls": "同时的模型调用过多。",
    "err.too_many_calls.next": "请等待一个调用结束。",
    "err.input_spike": "提示远大于平常，任务已结束。",
    "err.input_spike.next": "请用更短的请求。",
    "err.fetch_refused": "代理请求的页面不在公共互联网上。",
    "err.fetch_refused.next": "没有抓取任何内容。请使用公开的 http 或 https 地址。",
    "err.task_finished": "这个任务已经结束。",
    "err.task_finished.next": "它的结果已被接收，不能再为它发送任何内容。",
    "err.event_limit": "这个任务已发送了允许的全部进度更新。",
    "err.event_limit.next": "之后的更新不会显示；任务会继续进行。",
    "err.tool_limit": "这个任务已用完允许的页面抓取次数。",
    "err.tool_limit.next": "请用已经抓取到的内容完成回答。",
    "err.anomaly_blocked": "来自你的网络连接的异常请求已被暂停一段时间。",
    "err.anomaly_blocked.next": "本次没有计入次数。请在下方所示时间后再发送。",
    "err.token_rate_limited": "规划器本分钟的处理量已达上限。",
    "err.token_rate_limited.next": "本次没有计入次数。请在下方所示时间后再发送。",
    "err.key_daily_limit_reached": "此 API 密钥今天的规划次数已用完。",
    "err.key_daily_limit_reached.next": "次数将在 UTC 午夜重置。",
    "err.network": "无法连接到服务器。",
    "err.network.next": "请检查网络连接后重试。",
    "err.unknown": "发生了意外错误。",
    "err.unknown.next": "请稍后重试，或刷新页面。",
    "err.config": "页面无法加载设置。",
    "err.config.next": "请稍后刷新页面。",
    "err.turnstile_load": "人机验证无法加载。",
    "err.turnstile_load.next": "请在内容拦截器中允许 challenges.cloudflare.com，或换一个网络，然后刷新页面。",
    "err.turnstile_widget": "人机验证出现问题。",
    "err.turnstile_widget.next": "请等待它自动重试，或刷新页面。",
    "taskerr.model_unavailable": "规划器在生成你的行程时，模型停止了响应。",
    "taskerr.model_unavailable.next": "本次尝试仍计入今天的次数。请几分钟后再试。",
    "taskerr.agent_failed": "代理未能完成这个任务。",
    "taskerr.agent_failed.next": "请重试，或换一个更简单的请求。本次尝试仍计入今天的次数。",
    "taskerr.worker_lost": "正在生成你的行程的服务器在完成前停止了运行。",
    "taskerr.worker_lost.next": "你的行程不会被重复运行或重复计费，但本次尝试仍计入今天的次数。请用表单开始新的规划。",
    "taskerr.input_spike": "这个请求比平常大得多，因此规划器已停止，没有向模型发送请求。",
    "taskerr.input_spike.next": "本次尝试仍计入今天的次数。请尝试更简短的请求。",
    "taskerr.token_rate_limited": "规划器在完成你的行程前达到了每分钟的处理上限。",
    "taskerr.token_rate_limited.next": "本次尝试仍计入今天的次数。请等一分钟后再试。",
    "taskerr.agent_unreachable": "无法连接到为这个演示作答的代理。",
    "taskerr.agent_unreachable.next": "本次尝试仍计入今天的次数。请稍后再试。",
    "taskerr.agent_timeout": "代理接受了任务，但没有按时作答。",
    "taskerr.agent_timeout.next": "本次尝试仍计入今天的次数。请重试，或换一个更简单的请求。",
    "taskerr.unknown": "规划器未能完成这个行程。",
    "taskerr.unknown.next": "本次尝试仍计入今天的次数。请稍后重试。",
    "task.heading": "你的行程",
    "task.heading_for": "{destination} 行程",
    "task.status.queued": "状态：等待开始",
    "task.status.running": "状态：进行中",
    "task.status.succeeded": "状态：已完成",
    "task.status.failed": "状态：失败",
    "task.status.unknown": "状态：未知",
    "task.quota": "今日剩余规划次数：你还有 {ip} 次，全站还有 {global} 次。",
    "task.steps.heading": "进度",
    "task.steps.empty": "正在等待第一步…",
    "step.kind.model": "模型",
    "step.kind.tool": "工具",
    "step.kind.agent": "代理",
    "step.kind.unknown": "步骤",
    "step.status.started": "进行中…",
    "step.status.ok": "完成",
    "step.status.failed": "失败",
    "step.status.cached": "来自缓存",
    "step.status.degraded": "已用备用数据完成",
    "step.status.unknown": "未知",
    "task.result.heading": "行程安排",
    "task.day": "第 {n} 天",
    "task.day_prefix": "第 {n} 天：",
    "task.warnings.heading": "请注意",
    "task.model": "由模型 {model} 生成。",
    "task.model_offline": "由内置演示规划器 {model} 生成（不是语言模型）。",
    "task.usage": "使用的令牌：输入 {prompt}，输出 {completion}。",
    "task.cached": "这是为相同请求缓存的行程：没有消耗任何令牌。",
    "warn.weather_unavailable": "无法获取实时天气，因此行程按当季的常见天气安排。",
    "warn.search_unavailable": "旅行指南搜索不可用，因此行程基于一般常识。",
    "warn.fetch_failed": "部分网页无法获取，因此个别细节可能不够具体。",
    "warn.downstream_pushback": "某个数据源要求我们放慢速度，因此跳过了部分实时信息。",
    "warn.budget_exhausted": "令牌预算已用完，因此行程提前结束，内容可能较短。",
    "warn.output_truncated": "回答达到长度上限，已被截断。",
    "warn.output_loop": "模型开始重复内容，因此回答被提前终止。",
    "warn.step_limit": "规划器达到步骤上限，已根据现有信息完成行程。",
    "warn.tool_limit": "规划器达到查询次数上限，因此部分细节未能核实。",
    "warn.time_limit": "规划器用完了时间，已根据现有信息完成行程。",
    "warn.tool_loop": "规划器反复进行同一个查询，因此该查询被停止，行程在没有它的情况下完成。",
    "warn.low_precision": "部分细节只是大致信息；出发前请核实开放时间和价格。",
    "warn.fallback_model": "主模型不可用，因此本行程由备用模型生成。",
    "warn.unknown": "本行程受到某些限制，部分细节可能不完整。"
  }
};
// end of tables

/** Languages the page offers, in the order of the switch. */
export const LANGS = ['en', 'zh-CN'];

// Codes reach the tables as parts of keys; anything else (a hostile or
// garbled server answer) falls back to the generic text.
const CODE = /^[a-z0-9_]{1,64}$/;

/**
 * pickLanguage returns the stored choice when it is one we offer, otherwise
 * the first browser language we can serve (any Chinese variant gets
 * Simplified Chinese: closer than English for most readers), else English.
 */
export function pickLanguage(stored, preferred) {
  if (LANGS.includes(stored)) return stored;
  for (const tag of preferred || []) {
    const low = String(tag).toLowerCase();
    if (low === 'zh' || low.startsWith('zh-')) return 'zh-CN';
    if (low === 'en' || low.startsWith('en-')) return 'en';
  }
  return 'en';
}

/** translate looks key up in lang's table (English as a fallback) and fills {name} slots from params. */
export function translate(lang, key, params) {
  const table = TABLES[lang] || TABLES.en;
  let text = Object.hasOwn(table, key) ? table[key] : TABLES.en[key];
  if (text === undefined) text = key;
  if (!params) return text;
  return text.replace(/\{(\w+)\}/g, (slot, name) => (Object.hasOwn(params, name) ? String(params[name]) : slot));
}

/** hasKey reports whether key exists; both tables share their keys, so English decides. */
export function hasKey(key) {
  return Object.hasOwn(TABLES.en, key);
}

/** errorKey returns the table key prefix for an error code: "err.<code>" or "err.unknown". */
export function errorKey(code) {
  const key = 'err.' + code;
  return CODE.test(String(code)) && hasKey(key) && hasKey(key + '.next') ? key : 'err.unknown';
}

/** taskErrorKey returns the table key prefix for a failed task's code: "taskerr.<code>" or "taskerr.unknown". */
export function taskErrorKey(code) {
  const key = 'taskerr.' + code;
  return CODE.test(String(code)) && hasKey(key) && hasKey(key + '.next') ? key : 'taskerr.unknown';
}

/** warningKey returns the table key for a result warning code, or the generic one. */
export function warningKey(code) {
  const key = 'warn.' + code;
  return CODE.test(String(code)) && hasKey(key) ? key : 'warn.unknown';
}

/**
 * formatWait turns seconds into "5 h 12 min", "12 min" or "5 s". Minutes
 * round up so the page never tells a visitor to come back too early.
 */
export function formatWait(lang, seconds) {
  const s = Math.max(0, Math.ceil(Number(seconds) || 0));
  if (s < 60) return translate(lang, 'time.s', { s });
  const total = Math.ceil(s / 60);
  if (total < 60) return translate(lang, 'time.min', { m: total });
  const h = Math.floor(total / 60);
  const m = total % 60;
  return m === 0 ? translate(lang, 'time.h', { h }) : translate(lang, 'time.h_min', { h, m });
}

/** utcClock formats a moment as HH:MM in UTC, rounded to the nearest minute. */
export function utcClock(ms) {
  const d = new Date(Math.round(ms / 60000) * 60000);
  const pad = (n) => String(n).padStart(2, '0');
  return pad(d.getUTCHours()) + ':' + pad(d.getUTCMinutes());
}

// Waits this long or longer also get a wall-clock time: "in 5 h 12 min"
// alone makes the visitor do arithmetic, and daily limits end at a fixed hour.
const CLOCK_FROM_SECONDS = 600;

/** retryText renders a Retry-After wait measured from now (ms since the epoch). */
export function retryText(lang, seconds, now) {
  if (!Number.isFinite(seconds) || seconds < 0) return '';
  const rel = formatWait(lang, seconds);
  if (seconds < CLOCK_FROM_SECONDS) return translate(lang, 'retry.in', { rel });
  return translate(lang, 'retry.in_at', { rel, at: utcClock(now + seconds * 1000) });
}

/** durationKey picks the key and slots for a step duration in milliseconds. */
export function durationKey(ms) {
  const n = Math.max(0, Math.round(Number(ms)));
  if (n < 1000) return ['duration.ms', { n }];
  return ['duration.s', { n: (n / 1000).toFixed(n < 10000 ? 1 : 0) }];
}
