// The unmodified E2B JavaScript SDK against Strata's E2B listener: the
// main paths of tests/e2b/sdk_test.py (which holds every check) through
// the other SDK. Run by tests/e2b.rs with E2B_API_URL, E2B_SANDBOX_URL and
// E2B_API_KEY set, from the directory scripts/e2b-js.sh installs the SDK in.
import { Sandbox, CommandExitError, NotFoundError, AuthenticationError } from 'e2b'
const step = (s) => console.log('--- ' + s)
const assert = (c, m) => { if (!c) throw new Error('assertion failed: ' + m) }
step('create')
const sbx = await Sandbox.create({ metadata: { suite: 'js' }, envs: { FROM_CREATE: 'yes' } })
step('commands.run')
let r = await sbx.commands.run('echo hello; echo oops >&2; echo $FROM_CREATE; id -un')
assert(r.stdout === 'hello\nyes\nuser\n' && r.stderr === 'oops\n' && r.exitCode === 0, JSON.stringify(r))
try { await sbx.commands.run('exit 3'); assert(false, 'no error') } catch (e) { assert(e instanceof CommandExitError && e.exitCode === 3, String(e)) }
step('background + kill')
const h = await sbx.commands.run('sleep 100', { background: true })
assert((await sbx.commands.list()).some(p => p.pid === h.pid), 'listed')
assert(await h.kill(), 'killed')
step('files')
await sbx.files.write('/home/user/a.txt', 'alpha')
assert(await sbx.files.read('/home/user/a.txt') === 'alpha', 'read')
assert((await sbx.files.list('/home/user')).some(e => e.name === 'a.txt'), 'list')
assert(await sbx.files.exists('/home/user/a.txt'), 'exists')
await sbx.files.makeDir('/home/user/d')
await sbx.files.rename('/home/user/a.txt', '/home/user/d/b.txt')
assert(await sbx.files.read('/home/user/d/b.txt') === 'alpha', 'renamed')
await sbx.files.remove('/home/user/d')
assert(!(await sbx.files.exists('/home/user/d')), 'removed')
step('watchDir (stream)')
const events = []
const w = await sbx.files.watchDir('/home/user', (e) => events.push(e))
await sbx.files.write('/home/user/w.txt', 'x')
for (let i = 0; i < 50 && !events.some(e => e.name === 'w.txt'); i++) await new Promise(r => setTimeout(r, 100))
await w.stop()
assert(events.some(e => e.name === 'w.txt'), JSON.stringify(events))
step('pause, connect')
await sbx.files.write('/home/user/keep.txt', 'kept')
assert(await sbx.pause(), 'paused')
assert((await Sandbox.getInfo(sbx.sandboxId)).state === 'paused', 'state paused')
const again = await Sandbox.connect(sbx.sandboxId)
assert(await again.files.read('/home/user/keep.txt') === 'kept', 'kept')
step('list, getInfo')
const info = await Sandbox.getInfo(sbx.sandboxId)
assert(info.state === 'running', info.state)
step('errors')
try { await Sandbox.getInfo('i00000000000000000000'); assert(false, 'found') } catch (e) { assert(e instanceof NotFoundError, String(e)) }
try { await Sandbox.create({ apiKey: 'wrong' }); assert(false, 'created') } catch (e) { assert(e instanceof AuthenticationError, String(e)) }
step('kill')
await again.kill()
console.log('ALL E2B JS SDK CHECKS PASSED')
