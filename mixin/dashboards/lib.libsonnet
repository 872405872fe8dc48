// Plain Grafana dashboard JSON builders (no grafonnet: the mixin renders with nothing but
// the jsonnet package). Panels get their grid position and id from layout().
{
  // Every panel and query reads from the dashboard's `datasource` variable.
  local ds = { type: 'prometheus', uid: '${datasource}' },

  // A Prometheus query. `instant` + `format: 'table'` for table and stat panels.
  target(expr, legend='', instant=false, format='time_series'):: {
    datasource: ds,
    expr: std.stripChars(expr, '\n'),
    legendFormat: legend,
    instant: instant,
    range: !instant,
    format: format,
  },

  // refIds A, B, C... in query order (tables refer to their columns as "Value #A").
  local withRefIds(targets) = [
    targets[i] { refId: std.char(65 + i) }
    for i in std.range(0, std.length(targets) - 1)
  ],

  local panel(type, title, description, unit, targets, w, h) = {
    type: type,
    title: title,
    description: description,
    datasource: ds,
    targets: withRefIds(targets),
    fieldConfig: {
      defaults: {
        unit: unit,
        thresholds: { mode: 'absolute', steps: [{ color: 'green', value: null }] },
      },
      overrides: [],
    },
    gridW:: w,
    gridH:: h,
  },

  timeseries(title, unit, targets, description='', w=12, h=8, stack=false, max=null):: panel('timeseries', title, description, unit, targets, w, h) {
    fieldConfig+: {
      defaults+: {
        min: 0,
        [if max != null then 'max']: max,
        custom: {
          drawStyle: 'line',
          lineWidth: 1,
          fillOpacity: if stack then 30 else 10,
          showPoints: 'never',
          spanNulls: false,
          stacking: { mode: if stack then 'normal' else 'none', group: 'A' },
        },
      },
    },
    options: {
      legend: { displayMode: 'table', placement: 'bottom', showLegend: true, calcs: ['mean', 'max', 'lastNotNull'] },
      tooltip: { mode: 'multi', sort: 'desc' },
    },
  },

  // Draws the named series as dashed lines: requests, limits, capacities.
  dashed(names):: {
    fieldConfig+: {
      overrides+: [
        {
          matcher: { id: 'byName', options: name },
          properties: [
            { id: 'custom.lineStyle', value: { fill: 'dash', dash: [10, 10] } },
            { id: 'custom.fillOpacity', value: 0 },
          ],
        }
        for name in names
      ],
    },
  },

  stat(title, unit, targets, description='', w=4, h=4, mappings=[]):: panel('stat', title, description, unit, targets, w, h) {
    fieldConfig+: { defaults+: { mappings: mappings } },
    options: {
      reduceOptions: { calcs: ['lastNotNull'], fields: '', values: false },
      colorMode: 'value',
      graphMode: 'none',
      textMode: 'auto',
      justifyMode: 'auto',
      orientation: 'auto',
    },
  },

  // Value mapping for 0/1 gauges.
  boolMapping(off, offColor, on, onColor):: [{
    type: 'value',
    options: {
      '0': { text: off, color: offColor, index: 0 },
      '1': { text: on, color: onColor, index: 1 },
    },
  }],

  // A table of instant queries merged on their labels. `columns` maps each query's value
  // column ("Value #A", ...) to a header and unit, in query order; `hide` drops label columns.
  table(title, unit, targets, columns=[], description='', w=24, h=8, hide=[], sortBy=null):: panel('table', title, description, unit, targets, w, h) {
    local valueCol(i) = if std.length(targets) == 1 then 'Value' else 'Value #' + std.char(65 + i),
    transformations: [
      { id: 'merge', options: {} },
      {
        id: 'organize',
        options: {
          excludeByName: { [c]: true for c in ['Time', '__name__'] + hide },
          renameByName: { [valueCol(i)]: columns[i].name for i in std.range(0, std.length(columns) - 1) },
        },
      },
    ],
    fieldConfig+: {
      overrides: [
        {
          matcher: { id: 'byName', options: c.name },
          properties: [{ id: 'unit', value: c.unit }],
        }
        for c in columns
      ],
    },
    options: {
      showHeader: true,
      cellHeight: 'sm',
      footer: { show: false, reducer: ['sum'], fields: '' },
      sortBy: if sortBy == null then [] else [{ displayName: sortBy, desc: true }],
    },
  },

  // Markdown. Text panels show no data, so they carry no unit and no datasource.
  text(title, content, description, w=24, h=8):: {
    type: 'text',
    title: title,
    description: description,
    options: { mode: 'markdown', content: content },
    gridW:: w,
    gridH:: h,
  },

  // rows: [{ title, panels }]. Panels fill each row left to right, wrapping at 24 columns.
  layout(rows)::
    local place(state, p) =
      local wrap = state.x + p.gridW > 24;
      local x = if wrap then 0 else state.x;
      local y = if wrap then state.y + state.lineH else state.y;
      state {
        x: x + p.gridW,
        y: y,
        lineH: if wrap then p.gridH else std.max(state.lineH, p.gridH),
        id: state.id + 1,
        panels+: [p { id: state.id, gridPos: { x: x, y: y, w: p.gridW, h: p.gridH } }],
      };
    local addRow(state, row) =
      local y = state.y + state.lineH;
      std.foldl(place, row.panels, state {
        x: 0,
        y: y + 1,
        lineH: 0,
        id: state.id + 1,
        panels+: [{
          type: 'row',
          title: row.title,
          collapsed: false,
          panels: [],
          id: state.id,
          gridPos: { x: 0, y: y, w: 24, h: 1 },
        }],
      });
    std.foldl(addRow, rows, { x: 0, y: 0, lineH: 0, id: 1, panels: [] }).panels,

  // Template variables: a Prometheus datasource picker, then label_values() queries.
  datasourceVariable:: {
    name: 'datasource',
    label: 'Data source',
    type: 'datasource',
    query: 'prometheus',
    current: {},
    hide: 0,
    refresh: 1,
    regex: '',
    options: [],
  },

  queryVariable(name, label, query, multi=false):: {
    name: name,
    label: label,
    type: 'query',
    datasource: ds,
    query: query,
    definition: query,
    refresh: 2,  // on time range change: DaemonSet pods come and go.
    sort: 1,
    multi: multi,
    includeAll: multi,
    [if multi then 'allValue']: '.+',
    current: {},
    hide: 0,
    regex: '',
    options: [],
  },

  dashboard(cfg, uid, title, description, rows, variables):: {
    uid: uid,
    title: title,
    description: description,
    tags: cfg.dashboardTags,
    editable: true,
    graphTooltip: 1,  // shared crosshair
    refresh: cfg.dashboardRefresh,
    schemaVersion: 39,
    time: { from: cfg.dashboardTimeFrom, to: 'now' },
    timepicker: {},
    timezone: cfg.dashboardTimezone,
    annotations: { list: [] },
    links: [{
      type: 'dashboards',
      title: 'nettap',
      tags: cfg.dashboardTags,
      asDropdown: true,
      includeVars: true,
      keepTime: true,
    }],
    templating: { list: [$.datasourceVariable] + variables },
    panels: $.layout(rows),
  },
}
